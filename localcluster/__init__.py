"""Local mode: a Kubernetes cluster on this machine, for tests and `neuronfleet up`.

- `semantics`: Kubernetes API semantics without I/O (patches, selectors, schemas, tables, Status errors).
- `store`: the objects, their history and the REST semantics of writes; `ClusterClient` for in-process use.
- `apiserver`: the emulated API server's HTTP face (`python -m neuronfleet.localcluster.apiserver`).
- `processes`: one pod as a local process (command rewriting, supervision, readiness, status).
- `kubelet`: the process kubelet (claims, Jobs, Deployments, pods, Services) over a `ClusterClient`.
- `local`: `neuronfleet up | down | status`.

Neither the operator nor the runtime imports this package; it uses both.
"""
