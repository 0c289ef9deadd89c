{{/*
Names and labels, as in prometheus-community's charts. Selectors use only the name, the
instance and the component (never the chart version: a selector cannot change in place).
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "detour.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<name>" (just the release name when it already contains the name), or fullnameOverride. */}}
{{- define "detour.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "detour-0.1.0" for the helm.sh/chart label. */}}
{{- define "detour.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "detour.labels" -}}
helm.sh/chart: {{ include "detour.chart" . }}
app.kubernetes.io/part-of: detour
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of the Detour server. */}}
{{- define "detour.selectorLabels" -}}
app.kubernetes.io/name: {{ include "detour.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* Selector labels of the bundled Redis. */}}
{{- define "detour.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "detour.name" . }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: store
{{- end }}

{{/* The Detour image reference; the tag defaults to appVersion. */}}
{{- define "detour.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* "true" when the chart deploys its own Redis: enabled, and no external one given. */}}
{{- define "detour.redis.bundled" -}}
{{- if and .Values.redis.enabled (not .Values.externalRedis.url) (not .Values.externalRedis.existingSecret) -}}
true
{{- end }}
{{- end }}

{{/* Name of the bundled Redis' objects. */}}
{{- define "detour.redis.fullname" -}}
{{- printf "%s-redis" (include "detour.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the Redis URL: the user's, or the chart's (templates/secret.yaml). */}}
{{- define "detour.redis.secretName" -}}
{{- if .Values.externalRedis.existingSecret }}
{{- .Values.externalRedis.existingSecret }}
{{- else }}
{{- printf "%s-redis-url" (include "detour.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The key of the URL in that Secret. */}}
{{- define "detour.redis.secretKey" -}}
{{- if .Values.externalRedis.existingSecret }}
{{- .Values.externalRedis.existingSecretKey }}
{{- else -}}
url
{{- end }}
{{- end }}

{{/* The URL the chart's Secret holds: the bundled Redis's as the ACL user, no password
(that is in redisAuth's Secret). */}}
{{- define "detour.redis.url" -}}
{{- if .Values.externalRedis.url }}
{{- .Values.externalRedis.url }}
{{- else if .Values.redisAuth.username }}
{{- printf "redis://%s@%s:6379/0" .Values.redisAuth.username (include "detour.redis.fullname" .) }}
{{- else }}
{{- printf "redis://%s:6379/0" (include "detour.redis.fullname" .) }}
{{- end }}
{{- end }}

{{/* Refuse combinations that would deploy a broken or open service. */}}
{{- define "detour.validate" -}}
{{- if not (or (include "detour.redis.bundled" .) .Values.externalRedis.url .Values.externalRedis.existingSecret) }}
{{- fail "detour: no Redis: set redis.enabled=true, externalRedis.url or externalRedis.existingSecret (replicas must share one table)" }}
{{- end }}
{{- if and (include "detour.redis.bundled" .) (not (and .Values.redisAuth.existingSecret .Values.redisAuth.username)) }}
{{- fail "detour: the bundled Redis needs a password and its ACL user: set redisAuth.existingSecret (a Secret holding the password) and redisAuth.username (docs/deploy.md)" }}
{{- end }}
{{- if and (not .Values.auth.existingSecret) (not .Values.auth.allowOpen) }}
{{- fail "detour: no tokens: set auth.existingSecret to a Secret with the tokens file, or auth.allowOpen=true to run without" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) }}
{{- fail "detour: autoscaling.maxReplicas is below autoscaling.minReplicas" }}
{{- end }}
{{- end }}
