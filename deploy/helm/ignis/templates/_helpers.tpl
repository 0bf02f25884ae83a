{{- define "ignis.fullname" -}}
{{- printf "%s-ignis" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "ignis.labels" -}}
app.kubernetes.io/name: ignis
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ignis.selector" -}}
app.kubernetes.io/name: ignis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ignis.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{- define "ignis.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}{{ .Values.apiKey.existingSecret }}{{- else -}}{{ include "ignis.fullname" . }}-api-key{{- end -}}
{{- end -}}

{{- define "ignis.integrityKeySecret" -}}
{{- if .Values.engine.integrityKey.existingSecret -}}{{ .Values.engine.integrityKey.existingSecret }}{{- else -}}{{ include "ignis.fullname" . }}-engine-key{{- end -}}
{{- end -}}

{{- define "ignis.engineAuthSecret" -}}
{{- if .Values.engine.authSecret.existingSecret -}}{{ .Values.engine.authSecret.existingSecret }}{{- else -}}{{ include "ignis.fullname" . }}-engine-auth{{- end -}}
{{- end -}}

{{/* The engines' headless Service: its DNS name resolves to every ready engine pod. */}}
{{- define "ignis.engineService" -}}
{{ include "ignis.fullname" . }}-engine
{{- end -}}

{{- define "ignis.socket" -}}
{{ .Values.tierstore.socketDir }}/sock/tierstore.sock
{{- end -}}

{{- define "ignis.otel" -}}
{{- if .root.Values.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .root.Values.otlpEndpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "ignis-%s" .service | quote }}
{{- end }}
{{- end -}}

{{- define "ignis.env" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}
