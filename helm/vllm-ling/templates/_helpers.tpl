{{/* Names */}}
{{- define "vllm-ling.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-ling.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vllm-ling.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vllm-ling.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels. The job label of Prometheus targets is app.kubernetes.io/name (= vllm-ling),
so the alert rules' job="vllm-ling" holds in compose and Kubernetes alike. */}}
{{- define "vllm-ling.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-ling.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vllm-ling.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "vllm-ling.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Refuse inconsistent values, naming what to change. */}}
{{- define "vllm-ling.validate" -}}
{{- $v := .Values -}}
{{- if eq $v.mode "multinode" -}}
  {{- if lt (int $v.multinode.nodes) 2 -}}
    {{- fail (printf "mode=multinode needs multinode.nodes >= 2 (got %d); use mode=single for one node" (int $v.multinode.nodes)) -}}
  {{- end -}}
  {{- $gpus := mul (int $v.multinode.nodes) (int $v.multinode.gpusPerNode) -}}
  {{- $ranks := mul (int $v.multinode.tensorParallelSize) (int $v.multinode.pipelineParallelSize) -}}
  {{- if ne $gpus $ranks -}}
    {{- fail (printf "multinode.tensorParallelSize (%d) x multinode.pipelineParallelSize (%d) = %d must equal multinode.nodes (%d) x multinode.gpusPerNode (%d) = %d" (int $v.multinode.tensorParallelSize) (int $v.multinode.pipelineParallelSize) $ranks (int $v.multinode.nodes) (int $v.multinode.gpusPerNode) $gpus) -}}
  {{- end -}}
  {{- if and (eq $v.storage.models.type "pvc") (not $v.storage.models.existingClaim) (has "ReadWriteOnce" $v.storage.models.accessModes) (not (has "ReadOnlyMany" $v.storage.models.accessModes)) (not (has "ReadWriteMany" $v.storage.models.accessModes)) -}}
    {{- fail "mode=multinode: pods on different nodes cannot share a ReadWriteOnce models claim; set storage.models.accessModes to [ReadOnlyMany] or [ReadWriteMany], storage.models.existingClaim, or storage.models.type=hostPath" -}}
  {{- end -}}
  {{- if and (eq $v.storage.hummingCache.type "pvc") (not $v.storage.hummingCache.existingClaim) (not (has "ReadWriteMany" $v.storage.hummingCache.accessModes)) -}}
    {{- fail "mode=multinode: every node writes its humming cache; set storage.hummingCache.type=hostPath (one cache per node) or emptyDir, or storage.hummingCache.accessModes=[ReadWriteMany]" -}}
  {{- end -}}
{{- end -}}
{{- if and $v.apiKey.enabled (not $v.apiKey.existingSecret) -}}
  {{- fail "apiKey.enabled=true needs apiKey.existingSecret (a Secret holding the key; this chart never stores it). Set apiKey.enabled=false to serve /v1 without a key." -}}
{{- end -}}
{{- if and $v.ingress.enabled (not $v.ingress.host) -}}
  {{- fail "ingress.enabled=true needs ingress.host" -}}
{{- end -}}
{{- if and (eq $v.mode "multinode") $v.multinode.rayAuth.enabled (not $v.multinode.rayAuth.existingSecret) -}}
  {{- fail "multinode.rayAuth.enabled=true needs multinode.rayAuth.existingSecret (a Secret holding the Ray token; this chart never stores it). Set multinode.rayAuth.enabled=false only on a network nobody else reaches." -}}
{{- end -}}
{{- if and $v.multinode.rdma.enabled (ne $v.mode "multinode") -}}
  {{- fail "multinode.rdma.enabled=true only applies to mode=multinode" -}}
{{- end -}}
{{- end -}}

{{/* The image reference: repository:tag, pinned with @digest when image.digest is set. */}}
{{- define "vllm-ling.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- if .Values.image.digest -}}{{- $ref = printf "%s@%s" $ref .Values.image.digest -}}{{- end -}}
{{- $ref | quote -}}
{{- end -}}

{{/* Seconds a stopping pod gets: preStop pause + vLLM's drain (--shutdown-timeout) + the
30 s vllm-ling serve allows vLLM's teardown after it (launcher/supervisor.py TEARDOWN_MARGIN_S). */}}
{{- define "vllm-ling.terminationGracePeriodSeconds" -}}
{{- add (int .Values.serving.preStopSleepSeconds) (int .Values.serving.shutdownTimeout) 30 -}}
{{- end -}}

{{/* The server container's preStop: wait until the endpoint has left the Service, then
Kubernetes sends SIGTERM and vLLM drains. */}}
{{- define "vllm-ling.serverLifecycle" -}}
{{- if gt (int .Values.serving.preStopSleepSeconds) 0 -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.serving.preStopSleepSeconds | quote }}]
{{- end -}}
{{- end -}}

{{- define "vllm-ling.gpus" -}}
{{- if eq .Values.mode "multinode" -}}{{ .Values.multinode.gpusPerNode }}{{- else -}}{{ .Values.single.gpus }}{{- end -}}
{{- end -}}

{{/* Pod-level security: restricted Pod Security Standard. */}}
{{- define "vllm-ling.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container security: read-only root, no privilege escalation, no capabilities except
IPC_LOCK when RDMA is on (NCCL pins memory for the NIC). */}}
{{- define "vllm-ling.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
  {{- if and (eq .Values.mode "multinode") .Values.multinode.rdma.enabled }}
  add: [IPC_LOCK]
  {{- end }}
{{- end -}}

{{- define "vllm-ling.resources" -}}
{{- $gpu := dict (.Values.gpuResourceName) (include "vllm-ling.gpus" . | int) -}}
{{- $rdma := dict -}}
{{- if and (eq .Values.mode "multinode") .Values.multinode.rdma.enabled -}}
{{- $rdma = dict .Values.multinode.rdma.resourceName (int .Values.multinode.rdma.resourceCount) -}}
{{- end -}}
requests:
  {{- toYaml (merge (dict) $gpu $rdma (.Values.resources.requests | default dict)) | nindent 2 }}
limits:
  {{- toYaml (merge (dict) $gpu $rdma (.Values.resources.limits | default dict)) | nindent 2 }}
{{- end -}}

{{/* Environment shared by server, warmup and Ray workers. */}}
{{- define "vllm-ling.env" -}}
- name: VLLM_LING_MODEL
  value: {{ printf "/models/%s" .Values.model.name | quote }}
- name: VLLM_LING_HUMMING_CACHE
  value: /cache/humming
- name: VLLM_LING_TENSOR_PARALLEL_SIZE
  value: {{ (ternary .Values.multinode.tensorParallelSize .Values.single.gpus (eq .Values.mode "multinode")) | quote }}
{{- if eq .Values.mode "multinode" }}
- name: VLLM_LING_PIPELINE_PARALLEL_SIZE
  value: {{ .Values.multinode.pipelineParallelSize | quote }}
- name: VLLM_LING_RAY_NUM_GPUS
  value: {{ .Values.multinode.gpusPerNode | quote }}
{{- if .Values.multinode.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.multinode.rayAuth.existingSecret | quote }}
      key: {{ .Values.multinode.rayAuth.secretKey | quote }}
{{- end }}
{{- if .Values.multinode.networkInterface }}
- name: VLLM_LING_IFACE
  value: {{ .Values.multinode.networkInterface | quote }}
- name: NCCL_SOCKET_IFNAME
  value: {{ .Values.multinode.networkInterface | quote }}
- name: GLOO_SOCKET_IFNAME
  value: {{ .Values.multinode.networkInterface | quote }}
{{- else }}
- name: VLLM_HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}
{{- if .Values.multinode.rdma.enabled }}
- name: NCCL_IB_DISABLE
  value: "0"
{{- if .Values.multinode.rdma.hca }}
- name: NCCL_IB_HCA
  value: {{ .Values.multinode.rdma.hca | quote }}
{{- end }}
{{- else }}
- name: NCCL_IB_DISABLE
  value: "1"
{{- end }}
{{- end }}
{{- end -}}

{{- define "vllm-ling.serverEnv" -}}
{{ include "vllm-ling.env" . }}
- name: VLLM_LING_PORT
  value: {{ .Values.serving.port | quote }}
- name: VLLM_LING_MAX_MODEL_LEN
  value: {{ .Values.serving.maxModelLen | quote }}
- name: VLLM_LING_SHUTDOWN_TIMEOUT
  value: {{ .Values.serving.shutdownTimeout | quote }}
- name: VLLM_LING_GPU_MEMORY_UTILIZATION
  value: {{ .Values.serving.gpuMemoryUtilization | quote }}
{{- if .Values.serving.maxNumSeqs }}
- name: VLLM_LING_MAX_NUM_SEQS
  value: {{ .Values.serving.maxNumSeqs | quote }}
{{- end }}
{{- if .Values.model.servedModelName }}
- name: VLLM_LING_SERVED_MODEL_NAME
  value: {{ .Values.model.servedModelName | quote }}
{{- end }}
- name: VLLM_LING_TOOL_CALL_PARSER
  value: {{ .Values.serving.toolCallParser | quote }}
- name: VLLM_LING_REASONING_PARSER
  value: {{ .Values.serving.reasoningParser | quote }}
- name: VLLM_LING_MOE_BACKEND
  value: {{ .Values.optimizations.moeBackend | quote }}
- name: VLLM_LING_FP8_HEAD
  value: {{ ternary "1" "0" .Values.optimizations.fp8Head | quote }}
- name: VLLM_LING_MTP
  value: {{ ternary "1" "0" .Values.optimizations.mtp | quote }}
- name: VLLM_LING_NUM_SPEC_TOKENS
  value: {{ .Values.optimizations.numSpecTokens | quote }}
- name: VLLM_LING_VERIFY
  value: {{ .Values.optimizations.verify | quote }}
- name: VLLM_LING_REPORT_PATH
  value: /cache/vllm/vllm-ling-report.json
{{- if .Values.apiKey.enabled }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.existingSecret | quote }}
      key: {{ .Values.apiKey.secretKey | quote }}
{{- else }}
# apiKey.enabled=false is the operator's explicit choice; vllm-ling serve refuses otherwise.
- name: VLLM_LING_ALLOW_NO_API_KEY
  value: "1"
{{- end }}
{{- range $name, $value := .Values.serving.extraEnv }}
- name: {{ $name | quote }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{- define "vllm-ling.volumeMounts" -}}
- name: models
  mountPath: /models
  readOnly: true
- name: humming-cache
  mountPath: /cache/humming
- name: hf-cache
  mountPath: /cache/huggingface
- name: vllm-cache
  mountPath: /cache/vllm
- name: home
  mountPath: /home/vllm
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- end -}}

{{- define "vllm-ling.claimVolume" -}}
{{- $spec := index . 0 -}}{{- $hostPathType := index . 1 -}}{{- $claim := index . 2 -}}
{{- if eq $spec.type "hostPath" -}}
hostPath:
  path: {{ $spec.hostPath | quote }}
  type: {{ $hostPathType }}
{{- else if eq $spec.type "emptyDir" -}}
emptyDir: {}
{{- else -}}
persistentVolumeClaim:
  claimName: {{ default $claim $spec.existingClaim | quote }}
{{- end }}
{{- end -}}

{{- define "vllm-ling.volumes" -}}
- name: models
  {{- include "vllm-ling.claimVolume" (list .Values.storage.models "Directory" (printf "%s-models" (include "vllm-ling.fullname" .))) | nindent 2 }}
- name: humming-cache
  {{- include "vllm-ling.claimVolume" (list .Values.storage.hummingCache "DirectoryOrCreate" (printf "%s-humming-cache" (include "vllm-ling.fullname" .))) | nindent 2 }}
- name: hf-cache
  emptyDir: {}
- name: vllm-cache
  emptyDir: {}
- name: home
  emptyDir: {}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.storage.shmSizeLimit }}
{{- end -}}

{{- define "vllm-ling.probes" -}}
startupProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
readinessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
livenessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
{{- end -}}

{{/* Init container compiling the humming kernels into the cache volume. */}}
{{- define "vllm-ling.warmupInitContainer" -}}
- name: warmup
  image: {{ include "vllm-ling.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["vllm-ling", "warmup"]
  {{- if or .Values.warmup.tokenCounts .Values.warmup.rowCounts }}
  args:
    {{- with .Values.warmup.tokenCounts }}
    - --token-counts={{ . }}
    {{- end }}
    {{- with .Values.warmup.rowCounts }}
    - --row-counts={{ . }}
    {{- end }}
  {{- end }}
  env:
    {{- include "vllm-ling.env" . | nindent 4 }}
  resources:
    {{- include "vllm-ling.resources" . | nindent 4 }}
  securityContext:
    {{- include "vllm-ling.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    {{- include "vllm-ling.volumeMounts" . | nindent 4 }}
{{- end -}}

{{/* Scheduling and pod-wide settings shared by every pod template. */}}
{{- define "vllm-ling.podCommon" -}}
serviceAccountName: {{ include "vllm-ling.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ include "vllm-ling.terminationGracePeriodSeconds" . }}
securityContext:
  {{- include "vllm-ling.podSecurityContext" . | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
