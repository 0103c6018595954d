{{/*
Helpers shared by every template. Object names are fixed (one Tessera per
cluster); only the namespace follows the release.
*/}}

{{/* Labels on every object. */}}
{{- define "tessera.labels" -}}
app.kubernetes.io/name: tessera
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Selector labels of one component's pods: (list $ "component"). */}}
{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: tessera
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The Tessera image. */}}
{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
The kubelet plugin's service account. The DaemonSet runs as it and the
node-lock ValidatingAdmissionPolicy matches exactly it: both use this name.
*/}}
{{- define "tessera.kubeletPlugin.serviceAccountName" -}}
tessera-kubelet-plugin
{{- end }}

{{/* The user name the API server gives the kubelet plugin's pods. */}}
{{- define "tessera.kubeletPlugin.userName" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "tessera.kubeletPlugin.serviceAccountName" . }}
{{- end }}

{{/* The plugin's data directory on the host (--plugin-data-dir). */}}
{{- define "tessera.kubeletPlugin.dataDir" -}}
{{ .Values.kubeletPlugin.kubeletDir }}/plugins/gpu.tessera.dev
{{- end }}

{{/*
The image of MPS control-daemon pods (--mps-image): the only image the
kubelet plugin's pod policy lets a node run.
*/}}
{{- define "tessera.kubeletPlugin.mpsImage" -}}
{{ .Values.kubeletPlugin.mpsImage | default (include "tessera.image" .) }}
{{- end }}

{{/*
The image of IMEX daemon pods (--imex-image): the only image the plugin's
IMEX-lock policy lets a node run as one.
*/}}
{{- define "tessera.kubeletPlugin.imexImage" -}}
{{ .Values.kubeletPlugin.imex.image | default (include "tessera.image" .) }}
{{- end }}

{{/*
The host directory the plugin passes MPS and IMEX daemons as their driver root: the
driver root, or a fake node's files under the data directory (--fake-root).
*/}}
{{- define "tessera.kubeletPlugin.mpsDriverRoot" -}}
{{- if .Values.kubeletPlugin.fakeNode }}{{ include "tessera.kubeletPlugin.dataDir" . }}/fake-node{{ else }}{{ .Values.kubeletPlugin.driverRoot }}{{ end }}
{{- end }}

{{/* The user name the API server gives tessera-controller's pods. */}}
{{- define "tessera.controller.userName" -}}
system:serviceaccount:{{ .Release.Namespace }}:tessera-controller
{{- end }}

{{/*
A component's --metrics-address from its values: metricsBindAddress (an IPv6
address in brackets) and metricsPort.
*/}}
{{- define "tessera.metricsAddress" -}}
{{- if contains ":" .metricsBindAddress }}[{{ .metricsBindAddress }}]{{ else }}{{ .metricsBindAddress }}{{ end }}:{{ .metricsPort }}
{{- end }}

{{/*
"true" when a component's /metrics is reachable from outside its pod (its
metricsBindAddress is not a loopback address), so the pod declares the port.
*/}}
{{- define "tessera.metricsOpen" -}}
{{- if not (or (hasPrefix "127." .metricsBindAddress) (eq .metricsBindAddress "::1") (eq .metricsBindAddress "localhost")) }}true{{ end }}
{{- end }}

{{/* The webhook's Service (and Certificate) name. */}}
{{- define "tessera.webhook.name" -}}
tessera-webhook
{{- end }}
