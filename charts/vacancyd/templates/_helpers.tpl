{{/* The chart's name, or nameOverride. */}}
{{- define "vacancyd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 42 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name, at most 42 characters so "<name>-<upstream>-direct" fits.
fullnameOverride replaces it whole; nameOverride replaces the chart's part of it. */}}
{{- define "vacancyd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 42 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vacancyd.labels" -}}
app.kubernetes.io/name: {{ include "vacancyd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "vacancyd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vacancyd.name" . }}
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

{{/* The lender's API port, from its url (default 80, or 443 for https). */}}
{{- define "vacancyd.lenderApiPort" -}}
{{- $u := urlParse .url -}}
{{- $parts := splitList ":" $u.host -}}
{{- if gt (len $parts) 1 -}}{{ last $parts }}{{- else if eq $u.scheme "https" -}}443{{- else -}}80{{- end -}}
{{- end -}}

{{/* Pod-level settings shared by the companion and the helm test pod. */}}
{{- define "vacancyd.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- /* Who host-side publishing is bound to: the chart's ServiceAccount, plus users/groups. */ -}}
{{- define "vacancyd.hostPublisherSubjects" -}}
- kind: ServiceAccount
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
{{- range .root.Values.hostPublishing.users }}
- kind: User
  apiGroup: rbac.authorization.k8s.io
  name: {{ . | quote }}
{{- end }}
{{- range .root.Values.hostPublishing.groups }}
- kind: Group
  apiGroup: rbac.authorization.k8s.io
  name: {{ . | quote }}
{{- end }}
{{- end -}}

{{- /*
Pod settings: image, resources, nodeSelector, tolerations and affinity are top-level values.
They used to live under companion.; a key still set there wins (the image merged over the
top-level one), and NOTES.txt says which to move (vacancyd.deprecatedPodKeys).
Use: $pod := include "vacancyd.podValues" . | fromYaml
*/ -}}
{{- define "vacancyd.podValues" -}}
{{- $old := .Values.companion | default dict -}}
{{- $image := deepCopy (.Values.image | default dict) -}}
{{- if $old.image }}{{- $image = mergeOverwrite $image (deepCopy $old.image) -}}{{- end }}
image:
  {{- toYaml $image | nindent 2 }}
{{- range $key := list "resources" "nodeSelector" "tolerations" "affinity" }}
{{ $key }}:
  {{- toYaml (ternary (get $old $key) (get $.Values $key) (hasKey $old $key)) | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "vacancyd.deprecatedPodKeys" -}}
{{- $old := .Values.companion | default dict -}}
{{- $found := list -}}
{{- range $key := list "image" "resources" "nodeSelector" "tolerations" "affinity" }}
{{- if hasKey $old $key }}{{ $found = append $found (printf "companion.%s" $key) }}{{ end }}
{{- end -}}
{{- join ", " $found -}}
{{- end -}}
