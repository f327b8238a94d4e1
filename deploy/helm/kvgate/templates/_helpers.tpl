{{- define "kvgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvgate.labels" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.gpu.enabled -}}{{- $tag = printf "%s-gpu" $tag -}}{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* kvgate.yaml: the user's config with drain_timeout from drainTimeoutSeconds. */}}
{{- define "kvgate.config" -}}
{{- if hasKey .Values.config "drain_timeout" -}}
{{- fail "config.drain_timeout: set drainTimeoutSeconds instead (the pod's grace period is derived from it)" -}}
{{- end -}}
{{- if hasKey .Values.config "store" -}}
{{- fail "config.store: the database URL is a secret: set secrets.databaseURL.name (and .key) instead" -}}
{{- end -}}
{{- if and (empty .Values.config.backends) (not .Values.simulatedBackends) (not .Values.backendsFromEnv) -}}
{{- fail "config.backends: list the vLLM servers; with none kvgate serves simulated ones (set backendsFromEnv: true when KVGATE_BACKENDS comes from secrets.env, or simulatedBackends: true to try the chart without GPUs)" -}}
{{- end -}}
{{- if hasKey .Values.config "admin_key" -}}
{{- fail "config.admin_key: the admin key is a secret: set secrets.adminKey.name (and .key) instead" -}}
{{- end -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "addr" (printf "0.0.0.0:%d" (int .Values.service.port)) -}}
{{- $_ := set $cfg "data_dir" "/var/lib/kvgate" -}}
{{- $_ := set $cfg "drain_timeout" (printf "%ds" (int .Values.drainTimeoutSeconds)) -}}
{{- if not .Values.gpu.enabled -}}
{{- $nvml := default dict $cfg.nvml -}}
{{- $_ := set $nvml "disabled" true -}}
{{- $_ := set $cfg "nvml" $nvml -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}
