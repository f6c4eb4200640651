{{/* An image reference from images.<name>: repository@digest, or repository:tag (tag defaulting to appVersion). */}}
{{- define "goodput.image" -}}
{{- if .image.digest -}}
{{ .image.repository }}@{{ .image.digest }}
{{- else -}}
{{ .image.repository }}:{{ .image.tag | default .root.Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* imagePullSecrets, when images.pullSecrets names any. */}}
{{- define "goodput.pullSecrets" -}}
{{- with .Values.images.pullSecrets }}
      imagePullSecrets:
{{- range . }}
        - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* nodeSelector, tolerations and affinity of a component's values (pod spec level). */}}
{{- define "goodput.placement" -}}
{{- with .nodeSelector }}
      nodeSelector:
{{- toYaml . | nindent 8 }}
{{- end }}
{{- with .tolerations }}
      tolerations:
{{- toYaml . | nindent 8 }}
{{- end }}
{{- end -}}
