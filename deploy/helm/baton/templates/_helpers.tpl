{{- define "baton.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "baton.labels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "baton.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "baton.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.serviceDiscovery.namespace -}}
{{- end -}}

{{/* Baton's configuration file: the user's config plus what the chart owns. */}}
{{- define "baton.config" -}}
{{- $c := deepCopy (default dict .Values.config) -}}
{{- $_ := set $c "host" "0.0.0.0" -}}
{{- $_ := set $c "port" (int .Values.service.port) -}}
{{- $_ := set $c "metrics_port" (int .Values.service.metricsPort) -}}
{{- if .Values.serviceDiscovery.enabled -}}
{{- $_ := set $c "service_discovery" true -}}
{{- $_ := set $c "service_discovery_namespace" (include "baton.discoveryNamespace" .) -}}
{{- $_ := set $c "service_discovery_port" (int .Values.serviceDiscovery.port) -}}
{{- with .Values.serviceDiscovery.selector }}{{ $_ := set $c "selector" . }}{{ end -}}
{{- with .Values.serviceDiscovery.prefillSelector }}{{ $_ := set $c "prefill_selector" . }}{{ end -}}
{{- with .Values.serviceDiscovery.decodeSelector }}{{ $_ := set $c "decode_selector" . }}{{ end -}}
{{- end -}}
{{- if .Values.epp.enabled -}}
{{- if not .Values.epp.inferencePool.name -}}
{{- fail "epp.enabled needs epp.inferencePool.name: the InferencePool whose pods are the workers" -}}
{{- end -}}
{{- if .Values.serviceDiscovery.enabled -}}
{{- fail "epp.enabled finds the workers through the InferencePool: leave serviceDiscovery.enabled false (its namespace and PD selectors still apply)" -}}
{{- end -}}
{{- $_ := set $c "inference_pool" .Values.epp.inferencePool.name -}}
{{- $_ := set $c "grpc_port" (int .Values.epp.grpcPort) -}}
{{- $_ := set $c "grpc_health_port" (int .Values.epp.grpcHealthPort) -}}
{{- $_ := set $c "epp_secure_serving" .Values.epp.secureServing -}}
{{- if and .Values.epp.secureServing .Values.epp.tls.existingSecret -}}
{{- $_ := set $c "epp_tls_cert_path" "/etc/baton-epp-tls/tls.crt" -}}
{{- $_ := set $c "epp_tls_key_path" "/etc/baton-epp-tls/tls.key" -}}
{{- end -}}
{{- if .Values.epp.clientCA.existingSecret -}}
{{- if not .Values.epp.secureServing -}}
{{- fail "epp.clientCA needs epp.secureServing: client certificates are a TLS matter" -}}
{{- end -}}
{{- $_ := set $c "epp_client_ca_path" "/etc/baton-epp-ca/ca.crt" -}}
{{- end -}}
{{- $_ := set $c "service_discovery_namespace" (include "baton.discoveryNamespace" .) -}}
{{- with .Values.serviceDiscovery.prefillSelector }}{{ $_ := set $c "prefill_selector" . }}{{ end -}}
{{- with .Values.serviceDiscovery.decodeSelector }}{{ $_ := set $c "decode_selector" . }}{{ end -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}

{{/* Baton's drain: the grace period, less the preStop pause and 5 s to exit. */}}
{{- define "baton.drainSeconds" -}}
{{- $drain := sub (sub (int .Values.terminationGracePeriodSeconds) (int .Values.preStopSleepSeconds)) 5 -}}
{{- if lt $drain 1 -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed preStopSleepSeconds (%v) by more than 5 s: Baton needs time to drain" .Values.terminationGracePeriodSeconds .Values.preStopSleepSeconds) -}}
{{- end -}}
{{- $drain -}}
{{- end -}}
