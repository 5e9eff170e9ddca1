"""Local mode: a Kubernetes cluster on this machine, for tests and `neuronfleet up`.

- `semantics`: Kubernetes API semantics without I/O (patches, selectors, schemas, scale, Status errors).
- `admission`: names, labels and the defaults of built-in kinds, checked and filled in before a write.
- `tables`: what `kubectl get` prints, as server-side tables (kubectl's printers).
- `openapi`: the OpenAPI v3 and v2 documents kubectl reads (`kubectl explain`, field validation).
- `protobuf`: the protobuf bodies typed kubectl creates send, read as JSON.
- `store`: the objects, their indexes and bounded history, the REST semantics of writes; `ClusterClient`.
- `apiserver`: the emulated API server's HTTP face (`python -m neuronfleet.localcluster.apiserver`).
- `guard`: who may talk to it (a bearer token, its own Host, the API's media types); owner-only files.
- `tls`: its HTTPS certificate (kubectl sends tokens over HTTPS only) and the kubeconfig that trusts it.
- `processes`: one pod as a local process (command rewriting, supervision, restarts, status).
- `ports`: the loopback ports local processes get (below the ephemeral range).
- `probes`: a container's startup, readiness and liveness probes at their declared periods and thresholds.
- `events`: Events as the kubelet and controllers record them (repeats counted).
- `podlogs`: pod logs in the CRI format, read back under `kubectl logs`' options (follow, tail, since...).
- `kubelet`: the process kubelet (claims, Jobs and their TTL, Deployments, pods, Services) over a
  `ClusterClient`.
- `local`: `neuronfleet up | down | status`.

Neither the operator nor the runtime imports this package; it uses both.
"""
