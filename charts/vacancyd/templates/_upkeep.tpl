{{- /*
The Pod of a one-shot upkeep command (vacancyd k8s ...): the companion's image and the pod
and container security settings of the companion, so it is admitted where the companion is.
Called with (dict "root" $ "name" NAME "serviceAccount" SA "args" LIST).
*/ -}}
{{- define "vacancyd.upkeepPod" -}}
{{- $root := .root -}}
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
      image: "{{ $root.Values.companion.image.repository }}:{{ $root.Values.companion.image.tag | default $root.Chart.AppVersion }}"
      imagePullPolicy: {{ $root.Values.companion.image.pullPolicy }}
      args:
        {{- toYaml .args | nindent 8 }}
      {{- with $root.Values.extraEnv }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      resources:
        {{- toYaml $root.Values.companion.resources | nindent 8 }}
  {{- with $root.Values.companion.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.companion.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
