package main

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
)

// goTypes are what a configuration error must never show.
var goTypes = regexp.MustCompile(`scheduler\.|gpu\.|main\.|time\.Duration|int64|float64|\bstruct\b|!!|unmarshal`)

// TestConfigErrorsSayPathAndForm: a bad file, variable or flag is refused
// at start with the line, the key's YAML path and the form to write
// (30 for a duration: write 30s), in words and not in Go types.
func TestConfigErrorsSayPathAndForm(t *testing.T) {
	dir := t.TempDir()
	n := 0
	file := func(body string) []string {
		n++
		p := filepath.Join(dir, "c"+string(rune('a'+n))+".yaml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return []string{"--config", p}
	}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want []string
	}{
		{"misspelt key", file("admission:\n  kv_targt: 0.8\n"), nil, []string{"line 2: admission.kv_targt: unknown key (did you mean kv_target?)"}},
		{"unknown top-level key", file("addres: x\n"), nil, []string{"line 1: addres: unknown key (did you mean addr?)"}},
		{"unknown key in a list item", file("backends:\n  - url: http://a:8000\n    max_num_seq: 3\n"), nil,
			[]string{"line 3: backends[0].max_num_seq: unknown key (did you mean max_num_seqs?)"}},
		{"a duration without a unit", file("admission:\n  max_queue_wait: 30\n"), nil, []string{"line 2: admission.max_queue_wait:", "write 30s"}},
		{"a duration that is text", file("jobs: {lease: soon}\n"), nil, []string{"jobs.lease", "30s"}},
		{"a number that is text", file("gateway:\n  max_body_bytes: lots\n"), nil, []string{"gateway.max_body_bytes", "write a whole number"}},
		{"a float that is text", file("tracing: {sample_ratio: high}\n"), nil, []string{"tracing.sample_ratio", "write a number"}},
		{"a bool that is not", file("dev: maybe\n"), nil, []string{"line 1: dev:", "write true or false"}},
		{"a scalar for a list", file("backends: http://a:8000\n"), nil, []string{"backends", "write a list"}},
		{"a scalar for a mapping", file("nats:\n  tls: yes\n"), nil, []string{"line 2: nats.tls", "write a mapping of keys (ca_file, cert_file, key_file, server_name)"}},
		{"a mapping for text", file("addr: {host: x}\n"), nil, []string{"addr", "write text, not a mapping"}},
		{"an env duration without a unit", nil, map[string]string{"KVGATE_DRAIN_TIMEOUT": "30"}, []string{"KVGATE_DRAIN_TIMEOUT", "write 30s"}},
		{"a flag duration without a unit", []string{"--drain-timeout", "30"}, nil, []string{"--drain-timeout", "write 30s"}},
		{"a bad bool variable", nil, map[string]string{"KVGATE_DEV": "perhaps"}, []string{"KVGATE_DEV", "true or false"}},
		{"a bad log format", []string{"--log-format", "xml"}, nil, []string{"log_format", "text or json"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := loadConfig(t, tc.args, tc.env)
			if err == nil {
				t.Fatal("loaded")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if goTypes.MatchString(err.Error()) {
				t.Errorf("error %q names Go types", err)
			}
		})
	}
}

// TestSettingsNameFields: every environment variable and flag names a
// YAML key of the configuration, once.
func TestSettingsNameFields(t *testing.T) {
	seen := map[string]bool{}
	for _, s := range settings {
		if _, _, err := fieldByPath(reflectConfig(), s.path); err != nil {
			t.Errorf("setting %s: %v", s.path, err)
		}
		for _, k := range []string{"env " + s.env, "flag " + s.flag} {
			if !strings.HasSuffix(k, " ") && seen[k] {
				t.Errorf("%s is given twice", k)
			}
			seen[k] = true
		}
	}
}

// TestUnknownFlagIsShort: an unknown flag is two lines, the error and
// where the flags are, not the whole usage; --help prints the usage.
func TestUnknownFlagIsShort(t *testing.T) {
	var stdout, stderr syncBuffer
	if code := runMain(nil, []string{"serve", "--kv-targt", "0.9"}, noenv, &stdout, &stderr); code != 1 {
		t.Errorf("exit %d, want 1", code)
	}
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "flag provided but not defined: -kv-targt") || !strings.Contains(lines[1], "kvgate serve --help") {
		t.Errorf("unknown flag printed:\n%s", stderr.String())
	}
	stderr = syncBuffer{}
	if code := runMain(nil, []string{"serve", "--help"}, noenv, &stdout, &stderr); code != 0 {
		t.Errorf("--help: exit %d", code)
	}
	if out := stderr.String(); !strings.Contains(out, "Usage: kvgate serve") || !strings.Contains(out, "-otlp-endpoint") || !strings.Contains(out, "(env KVGATE_ADDR) [127.0.0.1:8080]") {
		t.Errorf("--help printed:\n%s", out)
	}
}

// TestTryLineNamesServedModel: start-up's example request names a model
// the configured backends serve, not the simulator's default.
func TestTryLineNamesServedModel(t *testing.T) {
	p, err := vllmsim.LookupProfile("h100x4-llama-3.1-70b")
	if err != nil {
		t.Fatal(err)
	}
	_, sim := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Speedup: 50})
	ctx, cancel := context.WithCancel(t.Context())
	var stdout, stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--addr", "127.0.0.1:0", "--no-nvml", "--data-dir", t.TempDir(), "--backend", sim.URL}, noenv, &stdout, &stderr)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	eventually.True(t, "the try line", func() bool { return strings.Contains(stdout.String(), "try: ") })
	if out := stdout.String(); !strings.Contains(out, `"model":"meta-llama/Llama-3.1-70B-Instruct"`) || !strings.Contains(out, "Authorization: Bearer") {
		t.Errorf("start-up printed:\n%s", out)
	}
}

func reflectConfig() reflect.Value { return reflect.ValueOf(defaultConfig()).Elem() }
