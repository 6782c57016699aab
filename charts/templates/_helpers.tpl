{{/* Names, labels, and the derived shape of the mesh: units (Pods) and addresses. */}}

{{- define "omni.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "omni.meshId" -}}
{{- default .Release.Name .Values.meshId | trunc 31 | trimSuffix "-" -}}
{{- end -}}

{{- define "omni.selectorLabels" -}}
app.kubernetes.io/name: omni-mesh
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "omni.labels" -}}
{{ include "omni.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Units: one Pod template per unit, {unit: [stage, ...]}. A stage without a group is
a unit of its own, named after it. */}}
{{- define "omni.units" -}}
{{- $units := dict -}}
{{- range $name, $stage := .Values.stages -}}
{{- $unit := $stage.group | default $name -}}
{{- $_ := set $units $unit (append (get $units $unit | default list) $name) -}}
{{- end -}}
{{- toJson $units -}}
{{- end -}}

{{/* Pod settings of a unit: from groups.<unit> for a group, else from its stage. */}}
{{- define "omni.podSettings" -}}
{{- $root := .root -}}
{{- $source := dict -}}
{{- $first := get $root.Values.stages (first .names) -}}
{{- if $first.group -}}
{{- $source = get $root.Values.groups .unit | default dict -}}
{{- else -}}
{{- $source = $first -}}
{{- end -}}
{{- $grace := 10 -}}
{{- range .names -}}
{{- $stage := get $root.Values.stages . -}}
{{- $runtime := (($stage.settings | default dict).runtime | default dict) -}}
{{- $grace = max $grace ($runtime.drain_grace_s | default 10 | int) -}}
{{- end -}}
{{- toJson (dict
  "replicas" ($source.replicas | default 1)
  "nodeSelector" ($source.nodeSelector | default dict)
  "tolerations" ($source.tolerations | default list)
  "affinity" ($source.affinity | default dict)
  "runtimeClassName" ($source.runtimeClassName | default "")
  "shmSize" ($source.shmSize | default "1Gi")
  "cudaIpc" ($source.cudaIpc | default false)
  "grace" (add $grace 5)
) -}}
{{- end -}}

{{/* Where the orchestrator dials a stage. In a cluster: the stage's headless Service by
DNS, so a round_robin channel reaches every replica; on the host network: loopback. */}}
{{- define "omni.stageAddress" -}}
{{- $root := .root -}}
{{- $stage := get $root.Values.stages .name -}}
{{- if $root.Values.hostNetwork -}}
127.0.0.1:{{ $stage.port | int }}
{{- else -}}
dns:///{{ include "omni.fullname" $root }}-{{ .name }}.{{ $root.Release.Namespace }}.svc.{{ $root.Values.clusterDomain }}:{{ $stage.port | int }}
{{- end -}}
{{- end -}}

{{/* Whether the orchestrator watches the stages' Pods through the Kubernetes API
(podWatch.enabled; never on the host network, where there is no cluster): "true" or "". */}}
{{- define "omni.podWatch" -}}
{{- if and .Values.podWatch.enabled (not .Values.hostNetwork) -}}true{{- end -}}
{{- end -}}

{{/* The label selector of a stage's Pods (those of its unit's Deployment), for the
orchestrator's Pod watch; "" without one. */}}
{{- define "omni.stagePods" -}}
{{- $root := .root -}}
{{- if include "omni.podWatch" $root -}}
{{- $stage := get $root.Values.stages .name -}}
{{- $labels := include "omni.selectorLabels" $root | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/component" "stage" -}}
{{- $_ := set $labels "omni-mesh.dev/unit" ($stage.group | default .name) -}}
{{- $pairs := list -}}
{{- range $key := keys $labels | sortAlpha -}}
{{- $pairs = append $pairs (printf "%s=%s" $key (get $labels $key)) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
{{- end -}}

{{/* The stage file (services/stage/config.py) of one stage. */}}
{{/* A stage's data port, where stages on other nodes pull its large tensors. */}}
{{- define "omni.dataPort" -}}
{{- add (.stage.port | int) (.offset | int) -}}
{{- end -}}

{{- define "omni.stageFile" -}}
{{- $stage := .stage -}}
{{- $file := deepCopy ($stage.settings | default dict) -}}
{{- $_ := set $file "name" .name -}}
{{- $_ := set $file "engine" $stage.engine -}}
{{- if $stage.model -}}
{{- $_ := set $file "model" $stage.model -}}
{{- end -}}
{{- if gt ($stage.gpus | default 0 | int) 0 -}}
{{- $runtime := $file.runtime | default dict -}}
{{- if not $runtime.device -}}
{{- $_ := set $runtime "device" "cuda" -}}
{{- end -}}
{{- $_ := set $file "runtime" $runtime -}}
{{- end -}}
{{- toYaml $file -}}
{{- end -}}

{{/* The Secret holding the mesh token (key mesh-token): auth.secretName, else the
one the chart generates (auth.meshToken), else none ("": stages take any caller). */}}
{{- define "omni.meshTokenSecret" -}}
{{- if .Values.auth.secretName -}}
{{- .Values.auth.secretName -}}
{{- else if .Values.auth.meshToken -}}
{{- printf "%s-mesh-token" (include "omni.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Env every container gets. */}}
{{- define "omni.commonEnv" -}}
- name: OMNI_MESH_ID
  value: {{ include "omni.meshId" . | quote }}
- name: OMNI_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: OMNI_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.otel.endpoint | quote }}
{{- end }}
{{- if .Values.tls.secretName }}
- name: OMNI_TLS_CERT
  value: /etc/omni/tls/tls.crt
- name: OMNI_TLS_KEY
  value: /etc/omni/tls/tls.key
- name: OMNI_TLS_CA
  value: /etc/omni/tls/ca.crt
{{- end }}
{{- if include "omni.meshTokenSecret" . }}
- name: OMNI_MESH_TOKEN_FILE
  value: /etc/omni/auth/mesh-token
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "omni.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "omni.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "omni.stageFiles" -}}
{{- range .names -}}
{{ include "omni.stageFile" (dict "name" . "stage" (get $.root.Values.stages .)) }}
{{ end -}}
{{- end -}}

{{- define "omni.cacheVolume" -}}
- name: model-cache
{{- if eq .Values.modelCache.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.pvc.existingClaim | default (printf "%s-model-cache" (include "omni.fullname" .)) }}
{{- else }}
  emptyDir: {sizeLimit: {{ .Values.modelCache.sizeLimit }}}
{{- end }}
{{- end -}}

{{/* Refuse what the schema cannot see: cross-references between stages, groups, edges. */}}
{{- define "omni.validate" -}}
{{- $root := . -}}
{{- if not .Values.stages -}}
{{- fail "stages: expected at least one stage" -}}
{{- end -}}
{{- $ports := dict -}}
{{- $offset := .Values.probes.healthPortOffset | int -}}
{{- $_ := set $ports (toString (.Values.orchestrator.port | int)) "the orchestrator (orchestrator.port)" -}}
{{- $_ := set $ports (toString (add .Values.orchestrator.port $offset)) "the orchestrator's health port (orchestrator.port + probes.healthPortOffset)" -}}
{{- $podKeys := list "replicas" "nodeSelector" "tolerations" "affinity" "runtimeClassName" "shmSize" -}}
{{- range $name, $stage := .Values.stages -}}
{{- $port := toString ($stage.port | int) -}}
{{- if hasKey $ports $port -}}
{{- fail (printf "stages.%s.port: %s is already taken by %s; expected a distinct port per stage" $name $port (get $ports $port)) -}}
{{- end -}}
{{- $_ := set $ports $port (printf "stage %s" $name) -}}
{{- $health := toString (add $stage.port $offset) -}}
{{- if hasKey $ports $health -}}
{{- fail (printf "stages.%s.port: its health port %s (port + probes.healthPortOffset) is already taken by %s; expected a distinct port per stage" $name $health (get $ports $health)) -}}
{{- end -}}
{{- if gt (int $health) 65535 -}}
{{- fail (printf "stages.%s.port: its health port %s (port + probes.healthPortOffset) is above 65535; expected a lower port or offset" $name $health) -}}
{{- end -}}
{{- $_ := set $ports $health (printf "stage %s's health port" $name) -}}
{{- if $stage.group -}}
{{- if and (hasKey $root.Values.stages $stage.group) (ne $stage.group $name) -}}
{{- $other := get $root.Values.stages $stage.group -}}
{{- if ne ($other.group | default "") $stage.group -}}
{{- fail (printf "stages.%s.group: %q is the name of stage %s, which is not in that group; expected another group name" $name $stage.group $stage.group) -}}
{{- end -}}
{{- end -}}
{{- range $podKeys -}}
{{- if hasKey $stage . -}}
{{- fail (printf "stages.%s.%s: stage %s runs in the Pod of group %s; set groups.%s.%s instead" $name . $name $stage.group $stage.group .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $units := include "omni.units" . | fromJson -}}
{{- range $group, $settings := .Values.groups -}}
{{- if not (hasKey $units $group) -}}
{{- fail (printf "groups.%s: no stage names this group (set stages.<name>.group: %s)" $group $group) -}}
{{- end -}}
{{- if and (gt (len (get $units $group)) 1) (gt ($settings.replicas | default 1 | int) 1) -}}
{{- fail (printf "groups.%s.replicas: expected 1 for a group of several stages (got %v): the orchestrator does not yet route one request's stages to one replica Pod, and a shared-memory hand-off needs that" $group $settings.replicas) -}}
{{- end -}}
{{- end -}}
{{- range $k, $edge := .Values.pipeline.edges -}}
{{- range $key := list "from" "to" -}}
{{- $target := get $edge $key -}}
{{- if not (hasKey $root.Values.stages $target) -}}
{{- fail (printf "pipeline.edges.%d.%s: unknown stage %q; expected one of %s" $k $key $target (keys $root.Values.stages | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $i, $name := .Values.pipeline.outputs -}}
{{- if not (hasKey $root.Values.stages $name) -}}
{{- fail (printf "pipeline.outputs.%d: unknown stage %q; expected one of %s" $i $name (keys $root.Values.stages | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The orchestrator's pipeline file (orchestrator/server/pipeline.py), stage addresses filled in. */}}
{{- define "omni.pipeline" -}}
{{- $root := . -}}
{{- $stages := list -}}
{{- range $name, $stage := .Values.stages -}}
{{- $stages = append $stages (dict
  "name" $name
  "address" (include "omni.stageAddress" (dict "root" $root "name" $name))
  "init_timeout_s" ($stage.initTimeoutS | default 600)
  "download_stall_timeout_s" ($stage.downloadStallTimeoutS | default 60)
  "alone" ($stage.alone | default false)
) -}}
{{- with include "omni.stagePods" (dict "root" $root "name" $name) -}}
{{- $_ := set (last $stages) "pods" . -}}
{{- end -}}
{{- end -}}
{{- $pipeline := dict "name" .Values.pipeline.name "stages" $stages -}}
{{- with .Values.pipeline.edges -}}
{{- $_ := set $pipeline "edges" . -}}
{{- end -}}
{{- with .Values.pipeline.outputs -}}
{{- $_ := set $pipeline "outputs" . -}}
{{- end -}}
{{- with .Values.pipeline.watchdog -}}
{{- $_ := set $pipeline "watchdog" . -}}
{{- end -}}
{{- with .Values.pipeline.runtime -}}
{{- $_ := set $pipeline "runtime" . -}}
{{- end -}}
{{- toYaml $pipeline -}}
{{- end -}}
