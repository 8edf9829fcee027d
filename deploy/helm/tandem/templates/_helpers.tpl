{{/* Names: <release>-tandem (or the release name when it already contains "tandem"), then -<part>. */}}
{{- define "tandem.fullname" -}}
{{- if contains "tandem" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-tandem" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (list $ "frontend"). */}}
{{- define "tandem.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tandem.image" -}}
{{- if not .Values.image.repository -}}
{{- fail "image.repository is required: an image with vLLM and tandem installed (deploy/docker/Dockerfile builds one)" -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "tandem.dynamoNamespace" -}}
{{- .Values.dynamoNamespace | default .Release.Name -}}
{{- end -}}

{{- define "tandem.usesNats" -}}
{{- if or (eq .Values.requestPlane "nats") (eq .Values.eventPlane "nats") -}}true{{- end -}}
{{- end -}}

{{- define "tandem.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "http://%s-etcd:2379" (include "tandem.fullname" .) -}}
{{- else -}}
{{- .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{- define "tandem.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s-nats:4222" (include "tandem.fullname" .) -}}
{{- else -}}
{{- .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "tandem.modelPath" -}}
{{- printf "/models/%s" (.Values.model.path | default .Values.model.name) -}}
{{- end -}}

{{- define "tandem.servedModelName" -}}
{{- .Values.model.servedModelName | default .Values.model.name -}}
{{- end -}}

{{/* Settings that contradict each other, or that nothing would use, stop the render with the reason. */}}
{{- define "tandem.validate" -}}
{{- if and (not .Values.etcd.enabled) (not .Values.etcd.endpoints) -}}
{{- fail "etcd.enabled is false and etcd.endpoints is empty: tandem needs etcd for discovery (bundle one, or name yours)" -}}
{{- end -}}
{{- if and .Values.etcd.enabled .Values.etcd.endpoints -}}
{{- fail "etcd.endpoints names an external etcd while etcd.enabled bundles one: set only one" -}}
{{- end -}}
{{- if and .Values.etcd.enabled (or .Values.etcd.authSecret .Values.etcd.tlsSecret) -}}
{{- fail "etcd.authSecret and etcd.tlsSecret are for an external etcd: the bundled one serves plain HTTP inside the cluster" -}}
{{- end -}}
{{- if include "tandem.usesNats" . -}}
{{- if and (not .Values.nats.enabled) (not .Values.nats.url) -}}
{{- fail "requestPlane or eventPlane is nats: set nats.enabled (bundled server) or nats.url" -}}
{{- end -}}
{{- else if or .Values.nats.enabled .Values.nats.url -}}
{{- fail "nats.enabled or nats.url is set but neither requestPlane nor eventPlane is nats: nothing would use it" -}}
{{- end -}}
{{- if and .Values.nats.enabled .Values.nats.url -}}
{{- fail "nats.url names an external NATS while nats.enabled bundles one: set only one" -}}
{{- end -}}
{{- if and .Values.durableKvEvents (ne .Values.eventPlane "nats") -}}
{{- fail "durableKvEvents keeps KV events in NATS JetStream: it needs eventPlane nats" -}}
{{- end -}}
{{- if and (not .Values.model.download) (or (not .Values.model.volume) (hasKey .Values.model.volume "emptyDir")) -}}
{{- fail "model.download is false but model.volume is an emptyDir: nothing would put the model there" -}}
{{- end -}}
{{- $encode := .Values.workers.encode -}}
{{- if gt (int $encode.replicas) 0 -}}
{{- if and (eq .Values.engine "vllm") (or (not $encode.storageVolume) (hasKey $encode.storageVolume "emptyDir")) -}}
{{- fail "workers.encode with engine vllm: set workers.encode.storageVolume, a volume every encoder and aggregated (or prefill) worker pod mounts (an emptyDir is one pod's own), such as a ReadWriteMany PersistentVolumeClaim" -}}
{{- end -}}
{{- end -}}
{{- if and $encode.storageVolume (or (eq (int $encode.replicas) 0) (eq .Values.engine "mocker")) -}}
{{- fail "workers.encode.storageVolume is set but no vLLM encoder runs (workers.encode.replicas is 0, or the engine is the mocker, whose encoders keep no files): nothing would use it" -}}
{{- end -}}
{{- $p := .Values.planner -}}
{{- if $p.enabled -}}
{{- if and (not $p.rbac.create) (not $p.rbac.serviceAccountName) -}}
{{- fail "planner.enabled needs a ServiceAccount that may get and patch deployments/scale: set planner.rbac.create (or planner.rbac.serviceAccountName to one you bound yourself)" -}}
{{- end -}}
{{- if and $p.throughputScaling (not $p.profile.volume) -}}
{{- fail "planner.throughputScaling sizes the pools from the workers' profile: set planner.profile.volume (the output of `tandem profile`), or turn throughputScaling off and loadBasedScaling on" -}}
{{- end -}}
{{- if and (not $p.throughputScaling) (not $p.loadBasedScaling) -}}
{{- fail "planner.throughputScaling and planner.loadBasedScaling are both off: the planner would have nothing to scale by" -}}
{{- end -}}
{{- $mode := include "tandem.plannerMode" . -}}
{{- if and (eq .Values.mode "agg") (ne $mode "agg") -}}
{{- fail (printf "planner.mode %s plans a pool of a disaggregated deployment, but mode is agg" $mode) -}}
{{- end -}}
{{- if and (eq .Values.mode "disagg") (eq $mode "agg") -}}
{{- fail "planner.mode agg plans one aggregated pool, but mode is disagg: use disagg, prefill or decode" -}}
{{- end -}}
{{- else if or $p.profile.volume $p.prometheusEndpoint -}}
{{- fail "planner.profile or planner.prometheusEndpoint is set but planner.enabled is false: nothing would use it" -}}
{{- end -}}
{{- end -}}

{{/* The planner's ServiceAccount: the one its RBAC creates (or names). */}}
{{- define "tandem.plannerServiceAccount" -}}
{{- .Values.planner.rbac.serviceAccountName | default (printf "%s-planner" (include "tandem.fullname" .)) -}}
{{- end -}}

{{- define "tandem.plannerMode" -}}
{{- .Values.planner.mode | default .Values.mode -}}
{{- end -}}

{{/* Environment every tandem process gets: discovery, planes, addresses, logging. */}}
{{- define "tandem.runtimeEnv" -}}
- name: DYN_NAMESPACE
  value: {{ include "tandem.dynamoNamespace" . | quote }}
- name: DYN_DISCOVERY_BACKEND
  value: etcd
- name: ETCD_ENDPOINTS
  value: {{ include "tandem.etcdEndpoints" . | quote }}
{{- with .Values.etcd.authSecret }}
- name: ETCD_AUTH_USERNAME
  valueFrom: {secretKeyRef: {name: {{ . }}, key: username}}
- name: ETCD_AUTH_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ . }}, key: password}}
{{- end }}
{{- if .Values.etcd.tlsSecret }}
- name: ETCD_AUTH_CA
  value: /etc/tandem/etcd-tls/ca.crt
- name: ETCD_AUTH_CLIENT_CERT
  value: /etc/tandem/etcd-tls/tls.crt
- name: ETCD_AUTH_CLIENT_KEY
  value: /etc/tandem/etcd-tls/tls.key
{{- end }}
- name: DYN_REQUEST_PLANE
  value: {{ .Values.requestPlane }}
- name: DYN_EVENT_PLANE
  value: {{ .Values.eventPlane }}
{{- if include "tandem.usesNats" . }}
- name: NATS_SERVER
  value: {{ include "tandem.natsUrl" . | quote }}
{{- include "tandem.natsAuthEnv" . }}
{{- end }}
# Peers reach the pod at its own address; every listener binds all of the pod's interfaces.
- name: DYN_ADVERTISE_HOST
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: DYN_TCP_RPC_HOST
  value: 0.0.0.0
- name: DYN_LOG
  value: {{ .Values.logging.level | quote }}
{{- if .Values.logging.json }}
- name: DYN_LOGGING_JSONL
  value: "true"
{{- end }}
{{- end -}}

{{- define "tandem.natsAuthEnv" -}}
{{- with .Values.nats.authSecret }}
{{- if eq $.Values.nats.authMode "token" }}
- name: NATS_AUTH_TOKEN
  valueFrom: {secretKeyRef: {name: {{ . }}, key: token}}
{{- else }}
- name: NATS_AUTH_USERNAME
  valueFrom: {secretKeyRef: {name: {{ . }}, key: username}}
- name: NATS_AUTH_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ . }}, key: password}}
{{- end }}
{{- end }}
{{- end -}}

{{/* Volumes and mounts every tandem pod has: the model, and the etcd client certificates. */}}
{{- define "tandem.volumes" -}}
- name: model
  {{- toYaml (.Values.model.volume | default (dict "emptyDir" (dict))) | nindent 2 }}
{{- with .Values.etcd.tlsSecret }}
- name: etcd-tls
  secret: {secretName: {{ . }}}
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
- name: model
  mountPath: /models
{{- if .Values.etcd.tlsSecret }}
- name: etcd-tls
  mountPath: /etc/tandem/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The init container that fetches the model (with model.download): call with (list $ "full") or (list $ "tokenizer"). */}}
{{- define "tandem.modelDownload" -}}
{{- $root := index . 0 -}}
- name: download-model
  image: {{ include "tandem.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  # huggingface_hub's Python API rather than its CLI, whose flags changed between releases.
  command:
    - python3
    - -c
    - |-
      import sys
      from huggingface_hub import snapshot_download
      name, revision, folder, *patterns = sys.argv[1:]
      snapshot_download(name, revision=revision, local_dir=folder, allow_patterns=patterns or None)
  args:
    - {{ $root.Values.model.name | quote }}
    - {{ $root.Values.model.revision | quote }}
    - {{ include "tandem.modelPath" $root | quote }}
    {{- if eq (index . 1) "tokenizer" }}
    {{- range list "tokenizer.json" "tokenizer_config.json" "generation_config.json" "config.json" "chat_template.jinja" "special_tokens_map.json" }}
    - {{ . }}
    {{- end }}
    {{- end }}
  env:
    - name: HF_HOME
      value: /models/.hf-home
    {{- with $root.Values.model.hfTokenSecret }}
    - name: HF_TOKEN
      valueFrom: {secretKeyRef: {name: {{ . }}, key: HF_TOKEN}}
    {{- end }}
  volumeMounts:
    - name: model
      mountPath: /models
  {{- with $root.Values.securityContext }}
  securityContext: {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
