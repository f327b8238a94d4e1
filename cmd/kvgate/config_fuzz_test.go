package main

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/gpu"
)

// FuzzConfigLoad loads arbitrary YAML files under arbitrary KVGATE_*
// variables. Loading is all or nothing: an error comes with no config.
// A config that loads is one serve can run: no negative duration or
// count, no NaN or infinite number, an admission policy that validates,
// keys and backends that the gateway and the pool take, a token count
// the gateway knows; the environment overrides the file where set, and
// the same input loads the same config twice.
func FuzzConfigLoad(f *testing.F) {
	for _, s := range []struct{ yaml, target, keys, backends, failOpen string }{
		{yaml: "addr: 0.0.0.0:9000\napi_keys:\n  - {key: sk-file, tenant: filetenant}\nbackends:\n  - {name: gpu0, url: \"http://10.0.0.5:8000\", gpus: [\"0\"], max_num_seqs: 128}\nadmission:\n  kv_target: 0.8\n  max_queue_wait: 5s\ngateway:\n  token_count: tokenize\nmetrics: {scrape_interval: 250ms}\n"},
		{yaml: "", target: "0.85", keys: "sk-env=envtenant, sk-op=ops:operator", backends: "http://a:8000, http://b:8000", failOpen: "true"},
		{yaml: "jobs: {concurrency: 8, lease: 30s, max_attempts: 3, default_deadline: 1h}\nquotas: {fail_open: true, cache_ttl: 2s}\nnats: {url: \"nats://127.0.0.1:4222\", replicas: 3}\n"},
		{yaml: "sim: {profile: h100-llama-3.1-8b, count: 3, speedup: 10}\nnvml: {disabled: true, interval: 1s}\nlog_level: debug\n"},
		{yaml: "gateway: {max_body_bytes: 1048576, default_max_tokens: 512, retries: 2, stream_idle_timeout: 1m, request_timeout: 5m}\n"},
		{yaml: "admission: {kv_target: 1.5}\n"},
		{yaml: "adress: x\n"},
		{yaml: "a: &a [1, 2]\nb: [*a, *a]\n"},
		{yaml: "backends: [{url: \"not a url\"}]\n"},
		{yaml: "addr: x\n---\n"},
		{yaml: "", keys: "=x"},
		{yaml: "", failOpen: "maybe"},
	} {
		f.Add([]byte(s.yaml), s.target, s.keys, s.backends, s.failOpen)
	}
	file := filepath.Join(f.TempDir(), "kvgate.yaml") // rewritten for each input, one at a time
	f.Fuzz(func(t *testing.T, yaml []byte, target, keys, backends, failOpen string) {
		if err := os.WriteFile(file, yaml, 0o600); err != nil {
			t.Fatal(err)
		}
		env := map[string]string{"KVGATE_CONFIG": file, "KVGATE_KV_TARGET": target, "KVGATE_API_KEYS": keys,
			"KVGATE_BACKENDS": backends, "KVGATE_QUOTA_FAIL_OPEN": failOpen}
		cfg, err := loadConfig(t, nil, env)
		again, err2 := loadConfig(t, nil, env)
		if (err == nil) != (err2 == nil) || !reflect.DeepEqual(cfg, again) && !hasNaN(reflect.ValueOf(cfg)) {
			t.Fatalf("the same input loads twice as %+v, %v and %+v, %v", cfg, err, again, err2)
		}
		if err != nil {
			if cfg != nil {
				t.Fatalf("error %v with a config: %+v", err, cfg)
			}
			return
		}
		checkRunnable(t, cfg)
		if n := documents(yaml); n > 1 {
			t.Fatalf("loaded a file of %d YAML documents, of which kvgate reads one", n)
		}
		if target != "" {
			if v, err := strconv.ParseFloat(target, 64); err != nil || cfg.Admission.KVTarget != v {
				t.Fatalf("KVGATE_KV_TARGET %q, yet kv_target %v", target, cfg.Admission.KVTarget)
			}
		}
		if b := splitList(backends); backends != "" && !slices.Equal(b, backendURLs(cfg.Backends)) {
			t.Fatalf("KVGATE_BACKENDS %q, yet backends %v", backends, backendURLs(cfg.Backends))
		}
		if keys != "" {
			want, _ := parseKeys(splitList(keys))
			if !slices.Equal(want, cfg.APIKeys) {
				t.Fatalf("KVGATE_API_KEYS %q, yet api_keys %+v", keys, cfg.APIKeys)
			}
		}
		if failOpen != "" {
			if v, _ := strconv.ParseBool(failOpen); cfg.Quotas.FailOpen != v {
				t.Fatalf("KVGATE_QUOTA_FAIL_OPEN %q, yet fail_open %v", failOpen, cfg.Quotas.FailOpen)
			}
		}
	})
}

// checkRunnable fails t unless serve could run cfg as it is.
func checkRunnable(t *testing.T, cfg *config) {
	t.Helper()
	if bad := badNumbers(reflect.ValueOf(*cfg), "config"); len(bad) > 0 {
		t.Fatalf("loaded with %s: %+v", strings.Join(bad, ", "), cfg)
	}
	if err := cfg.Admission.Validate(); err != nil {
		t.Fatalf("loaded with an invalid admission policy: %v", err)
	}
	if _, _, err := cfg.keyMaps(); err != nil {
		t.Fatalf("loaded with keys serve refuses: %v", err)
	}
	if len(cfg.Backends) > 0 {
		if _, err := gpu.NewPool(cfg.Backends, gpu.PoolConfig{}); err != nil {
			t.Fatalf("loaded with backends the pool refuses: %v", err)
		}
	}
	if err := gateway.CheckCacheTTL(cfg.Quotas.CacheTTL); err != nil {
		t.Fatalf("loaded with a cache TTL the gateway refuses: %v", err)
	}
	if tc := cfg.Gateway.TokenCount; tc != "" && tc != "estimate" && tc != "tokenize" {
		t.Fatalf("loaded with token_count %q, which the gateway refuses", tc)
	}
	if _, err := newLogger(nil, cfg.LogLevel); err != nil {
		t.Fatalf("loaded with a log level serve refuses: %v", err)
	}
}

// badNumbers lists the negative durations and counts and the NaN,
// infinite or negative floats in v, by their path.
func badNumbers(v reflect.Value, path string) []string {
	var bad []string
	switch v.Kind() {
	case reflect.Struct:
		for i := range v.NumField() {
			bad = append(bad, badNumbers(v.Field(i), path+"."+v.Type().Field(i).Name)...)
		}
	case reflect.Slice:
		for i := range v.Len() {
			bad = append(bad, badNumbers(v.Index(i), path+"["+strconv.Itoa(i)+"]")...)
		}
	case reflect.Pointer:
		if !v.IsNil() {
			bad = append(bad, badNumbers(v.Elem(), path)...)
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		if v.Int() < 0 {
			if v.Type() == reflect.TypeFor[time.Duration]() {
				return []string{path + " " + time.Duration(v.Int()).String()}
			}
			return []string{path + " " + strconv.FormatInt(v.Int(), 10)}
		}
	case reflect.Float32, reflect.Float64:
		if f := v.Float(); math.IsNaN(f) || math.IsInf(f, 0) || f < 0 {
			return []string{path + " " + strconv.FormatFloat(f, 'g', -1, 64)}
		}
	}
	return bad
}

// hasNaN reports whether v holds a NaN, which no config equals, itself
// included.
func hasNaN(v reflect.Value) bool {
	return slices.ContainsFunc(badNumbers(v, ""), func(s string) bool { return strings.HasSuffix(s, "NaN") })
}

// documents counts the YAML documents in b that hold something.
func documents(b []byte) int {
	dec := yaml.NewDecoder(bytes.NewReader(b))
	n := 0
	for {
		var doc yaml.Node
		if dec.Decode(&doc) != nil {
			return n
		}
		if len(doc.Content) > 0 && doc.Content[0].Tag != "!!null" {
			n++
		}
	}
}

func backendURLs(bs []gpu.BackendConfig) []string {
	var urls []string
	for _, b := range bs {
		urls = append(urls, b.URL)
	}
	return urls
}
