{{- /*
The Pod of a one-shot upkeep command (vacancyd k8s ...): the chart's image and the pod
and container settings the companion has, so it is admitted where the companion is.
Called with (dict "root" $ "name" NAME "serviceAccount" SA "args" LIST).
*/ -}}
{{- define "vacancyd.upkeepPod" -}}
{{- $root := .root -}}
{{- $pod := include "vacancyd.podValues" $root | fromYaml -}}
metadata:
  labels:
    {{- include "vacancyd.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .name }}
spec:
  restartPolicy: Never
  serviceAccountName: {{ .serviceAccount }}
  automountServiceAccountToken: true
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  containers:
    - name: {{ .name }}
      image: "{{ $pod.image.repository }}:{{ $pod.image.tag | default $root.Chart.AppVersion }}"
      imagePullPolicy: {{ $pod.image.pullPolicy }}
      args:
        {{- toYaml .args | nindent 8 }}
      {{- with $root.Values.extraEnv }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      resources:
        {{- toYaml $pod.resources | nindent 8 }}
  {{- with $pod.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pod.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
