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

{{/* The settings every gateway Deployment reads (goodput-gateway, goodput-gateway-batch), as env entries. */}}
{{- define "goodput.gatewayEnv" }}
            # per service: requests held while it has no ready replica, and for how long
            - name: GATEWAY_MAX_HELD_REQUESTS
              value: {{ .Values.gateway.maxHeldRequests | quote }}
            - name: GATEWAY_HOLD_SECONDS
              value: {{ .Values.gateway.holdSeconds | quote }}
            # replicas tried for a request that fails before its response headers
            - name: GATEWAY_ATTEMPTS
              value: {{ .Values.gateway.attempts | quote }}
            # seconds a service's API keys, read from its Secret, are kept
            - name: GATEWAY_API_KEY_TTL
              value: {{ .Values.gateway.auth.apiKeyTtlSeconds | quote }}
            # requests in flight per ready replica before the rest wait their fair turn (0: no cap)
            - name: GATEWAY_MAX_IN_FLIGHT_PER_REPLICA
              value: {{ .Values.gateway.maxInFlightPerReplica | quote }}
            - name: GATEWAY_QUEUE_SECONDS
              value: {{ .Values.gateway.queueSeconds | quote }}
{{- with .Values.gateway.tenants.secretName }}
            # tenants: their API keys and limits, YAML under the Secret's key tenants.yaml
            - name: GATEWAY_TENANTS_SECRET
              value: {{ printf "%s/%s" $.Release.Namespace . | quote }}
            - name: GATEWAY_TENANT_METRICS_CAP
              value: {{ $.Values.gateway.tenants.metricsCap | quote }}
{{- end }}
{{- end -}}
