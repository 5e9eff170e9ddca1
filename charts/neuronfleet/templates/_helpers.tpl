{{/* The release's full name, at most 63 characters. */}}
{{- define "neuronfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator pod. */}}
{{- define "neuronfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels on every object of the chart. */}}
{{- define "neuronfleet.labels" -}}
{{ include "neuronfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "neuronfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "neuronfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The operator's permissions: exactly the (API group, resource, verbs) of neuronfleet.operator.kube.RBAC_RULES,
the one table the operator's API module is checked against (tests/unit/test_chart.py compares the two), and
those of kube.OPT_IN_RULES whose value is set (rbac.podDeletionCost; rbac.readNodes, cluster-scoped kinds,
has a ClusterRole of its own in rbac.yaml).
*/}}
{{- define "neuronfleet.rules" -}}
- apiGroups: ["neuronfleet.dev"]
  resources: ["neuronmodels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["neuronfleet.dev"]
  resources: ["neuronmodels/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaimtemplates"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
{{- if .Values.rbac.podDeletionCost }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["patch"]
{{- end }}
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "create", "patch", "delete"]
{{- end -}}


{{/*
The operator's NEURONFLEET_NETWORK_POLICY (operator/network_policy.py): whom the models' NetworkPolicies admit
besides their own pods, as JSON: this release's operator pods (its selector labels, in its namespace, by the
kubernetes.io/metadata.name label every namespace carries: https://kubernetes.io/docs/concepts/
services-networking/network-policies/#targeting-a-namespace-by-its-name), the networkPolicy values'
metricsFrom (Prometheus) and clientsFrom (empty: any source).
*/}}
{{- define "neuronfleet.networkPolicy" -}}
{{- $operator := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "neuronfleet.selectorLabels" . | fromYaml)) -}}
{{- dict "operator" (list $operator) "metrics" .Values.networkPolicy.metricsFrom "clients" .Values.networkPolicy.clientsFrom | toJson -}}
{{- end -}}
