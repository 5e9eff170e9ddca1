"""Local mode: a Kubernetes cluster on this machine, for tests and `neuronfleet up`.

- `semantics`: Kubernetes API semantics without I/O (patches, selectors, schemas, tables, Status errors).
- `store`: the objects, their history and the REST semantics of writes; `ClusterClient` for in-process use.
- `apiserver`: the emulated API server's HTTP face (`python -m neuronfleet.localcluster.apiserver`).
- `processes`: one pod as a local process (command rewriting, supervision, restarts, status).
- `probes`: a container's startup, readiness and liveness probes at their declared periods and thresholds.
- `events`: Events as the kubelet and controllers record them (repeats counted).
- `podlogs`: pod logs in the CRI format, read back under `kubectl logs`' options (follow, tail, since...).
- `kubelet`: the process kubelet (claims, Jobs and their TTL, Deployments, pods, Services) over a
  `ClusterClient`.
- `local`: `neuronfleet up | down | status`.

Neither the operator nor the runtime imports this package; it uses both.
"""
