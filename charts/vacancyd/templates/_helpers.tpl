{{/* Release-scoped name, at most 42 characters so "<name>-<upstream>-direct" fits. */}}
{{- define "vacancyd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 42 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vacancyd.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "vacancyd.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: companion
{{- end -}}

{{- define "vacancyd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-companion" (include "vacancyd.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "vacancyd.hasNodes" -}}
{{- range .Values.lenders }}{{ if .node }}yes{{ end }}{{ end -}}
{{- end -}}
