package deploy

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
)

// schema is the part of an OpenAPI v3 schema the ScaledObject check needs.
type schema struct {
	typ      string             // object, array, string, integer, boolean
	props    map[string]*schema // object fields; nil with strMap: a map of strings
	strMap   bool               // additionalProperties: {type: string}
	required []string
	items    *schema
	enum     []string
	minLen   int
}

func obj_(required []string, props map[string]*schema) *schema {
	return &schema{typ: "object", props: props, required: required}
}

var (
	str     = &schema{typ: "string"}
	integer = &schema{typ: "integer"}
	boolean = &schema{typ: "boolean"}
	anyObj  = &schema{typ: "object"} // fields below it are not checked here
)

// scaledObjectSchema is KEDA's ScaledObject (keda.sh/v1alpha1) as its CRD
// publishes it: config/crd/bases/keda.sh_scaledobjects.yaml in
// github.com/kedacore/keda at 8b4f083ca8c8c2baf8477e322bd4d16ac4dfa09a
// (v2.20.1-117), controller-gen v0.20.1: the spec's fields with their types
// and required fields, the trigger's, and scaleTargetRef's. The CRD's
// structural schema prunes or refuses what it does not declare, so a field
// missing here is a field KEDA would drop.
var scaledObjectSchema = obj_([]string{"spec"}, map[string]*schema{
	"apiVersion": str,
	"kind":       str,
	"metadata":   anyObj,
	"spec": obj_([]string{"scaleTargetRef", "triggers"}, map[string]*schema{
		"advanced": obj_(nil, map[string]*schema{
			"horizontalPodAutoscalerConfig": obj_(nil, map[string]*schema{"behavior": anyObj, "name": str}),
			"restoreToOriginalReplicaCount": boolean,
			"scalingModifiers": obj_(nil, map[string]*schema{
				"activationTarget": str, "formula": str, "target": str,
				"metricType": {typ: "string", enum: []string{"AverageValue", "Value"}},
			}),
		}),
		"cooldownPeriod": integer,
		"fallback": obj_([]string{"failureThreshold", "replicas"}, map[string]*schema{
			"behavior":         {typ: "string", enum: []string{"static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower", "scalingModifiers"}},
			"failureThreshold": integer, "replicas": integer,
		}),
		"idleReplicaCount":      integer,
		"initialCooldownPeriod": integer,
		"maxReplicaCount":       integer,
		"minReplicaCount":       integer,
		"pollingInterval":       integer,
		"scaleTargetRef": obj_([]string{"name"}, map[string]*schema{
			"apiVersion": str, "envSourceContainerName": str, "kind": str,
			"name": {typ: "string", minLen: 1},
		}),
		"triggers": {typ: "array", items: obj_([]string{"metadata", "type"}, map[string]*schema{
			"authenticationRef": obj_([]string{"name"}, map[string]*schema{
				"kind": {typ: "string", enum: []string{"TriggerAuthentication", "ClusterTriggerAuthentication"}},
				"name": str,
			}),
			"metadata":         {typ: "object", strMap: true},
			"metricType":       str, // "Value", "AverageValue" or "Utilization" (the CRD's description)
			"name":             str,
			"type":             str,
			"useCachedMetrics": boolean,
		})},
	}),
	"status": anyObj,
})

// prometheusScalerKeys are the trigger metadata keys of KEDA's prometheus
// scaler (pkg/scalers/prometheus_scaler.go at the same commit, its keda:""
// tags): required ones first.
var (
	prometheusScalerRequired = []string{"serverAddress", "query", "threshold"}
	prometheusScalerOptional = []string{"queryParameters", "activationThreshold", "namespace", "customHeaders",
		"ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner", "authModes"}
	metricTypes = []string{"Value", "AverageValue", "Utilization"}
)

// validate returns where v breaks s.
func (s *schema) validate(path string, v any) []string {
	var errs []string
	bad := func(format string, args ...any) { errs = append(errs, path+": "+fmt.Sprintf(format, args...)) }
	switch s.typ {
	case "object":
		m, ok := v.(map[string]any)
		if !ok {
			bad("want an object, got %T", v)
			return errs
		}
		for _, r := range s.required {
			if _, ok := m[r]; !ok {
				bad("required field %s missing", r)
			}
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			switch {
			case s.strMap:
				if _, ok := m[k].(string); !ok {
					bad("%s: want a string (the CRD's additionalProperties), got %T", k, m[k])
				}
			case s.props == nil: // not checked below this level
			case s.props[k] == nil:
				bad("unknown field %s", k)
			default:
				errs = append(errs, s.props[k].validate(path+"."+k, m[k])...)
			}
		}
	case "array":
		a, ok := v.([]any)
		if !ok {
			bad("want an array, got %T", v)
			return errs
		}
		for i, e := range a {
			errs = append(errs, s.items.validate(fmt.Sprintf("%s[%d]", path, i), e)...)
		}
	case "string":
		str, ok := v.(string)
		if !ok {
			bad("want a string, got %T", v)
		} else if len(str) < s.minLen {
			bad("shorter than %d", s.minLen)
		} else if s.enum != nil && !slices.Contains(s.enum, str) {
			bad("%q is not one of %v", str, s.enum)
		}
	case "integer":
		f, ok := v.(float64)
		if !ok || f != math.Trunc(f) || f > math.MaxInt32 || f < math.MinInt32 {
			bad("want an int32, got %v", v)
		}
	case "boolean":
		if _, ok := v.(bool); !ok {
			bad("want a boolean, got %T", v)
		}
	}
	return errs
}

// checkScaledObject validates a ScaledObject against KEDA's schema and
// each prometheus trigger against the scaler's metadata keys.
func checkScaledObject(so map[string]any) []string {
	errs := scaledObjectSchema.validate("ScaledObject", so)
	if so["apiVersion"] != "keda.sh/v1alpha1" || so["kind"] != "ScaledObject" {
		errs = append(errs, fmt.Sprintf("apiVersion %v kind %v", so["apiVersion"], so["kind"]))
	}
	spec := obj(so["spec"])
	if minR, maxR := spec["minReplicaCount"], spec["maxReplicaCount"]; minR != nil && maxR != nil && minR.(float64) > maxR.(float64) {
		errs = append(errs, fmt.Sprintf("minReplicaCount %v above maxReplicaCount %v", minR, maxR))
	}
	triggers, _ := spec["triggers"].([]any)
	for i, tr := range triggers {
		tr := obj(tr)
		where := fmt.Sprintf("trigger %d", i)
		if mt, ok := tr["metricType"].(string); ok && !slices.Contains(metricTypes, mt) {
			errs = append(errs, fmt.Sprintf("%s: metricType %q not one of %v", where, mt, metricTypes))
		}
		if tr["type"] != "prometheus" {
			continue
		}
		md := obj(tr["metadata"])
		for _, k := range prometheusScalerRequired {
			if s, _ := md[k].(string); strings.TrimSpace(s) == "" {
				errs = append(errs, fmt.Sprintf("%s: the prometheus scaler needs metadata.%s", where, k))
			}
		}
		for k := range md {
			if !slices.Contains(prometheusScalerRequired, k) && !slices.Contains(prometheusScalerOptional, k) {
				errs = append(errs, fmt.Sprintf("%s: metadata.%s is no prometheus scaler key", where, k))
			}
		}
		for _, k := range []string{"threshold", "activationThreshold"} {
			if s, ok := md[k].(string); ok {
				var f float64
				if _, err := fmt.Sscan(s, &f); err != nil {
					errs = append(errs, fmt.Sprintf("%s: metadata.%s %q is not a number", where, k, s))
				}
			}
		}
	}
	return errs
}
