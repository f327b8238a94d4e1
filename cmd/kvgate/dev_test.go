package main

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDevConfig: development mode comes from the YAML file, then
// KVGATE_DEV, then --dev, each over the one before; it is off by default.
func TestDevConfig(t *testing.T) {
	file := filepath.Join(t.TempDir(), "kvgate.yaml")
	if err := os.WriteFile(file, []byte("dev: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want bool
	}{
		{"default", nil, nil, false},
		{"yaml", []string{"--config", file}, nil, true},
		{"env over yaml", []string{"--config", file}, map[string]string{"KVGATE_DEV": "false"}, false},
		{"env", nil, map[string]string{"KVGATE_DEV": "true"}, true},
		{"flag over env", []string{"--dev=false"}, map[string]string{"KVGATE_DEV": "true"}, false},
		{"flag", []string{"--dev"}, nil, true},
	} {
		cfg, _, err := parseConfig("serve", "", tc.args, func(k string) string { return tc.env[k] }, io.Discard)
		if err != nil || cfg.Dev != tc.want {
			t.Errorf("%s: dev %v, %v; want %v", tc.name, cfg != nil && cfg.Dev, err, tc.want)
		}
	}
	if _, _, err := parseConfig("serve", "", nil, func(k string) string { return map[string]string{"KVGATE_DEV": "maybe"}[k] }, io.Discard); err == nil {
		t.Error("KVGATE_DEV=maybe was taken")
	}
}

// TestServeDevMode: serve without keys answers 401 to an anonymous caller
// unless started with --dev, which it says once in its log.
func TestServeDevMode(t *testing.T) {
	for _, dev := range []bool{false, true} {
		flag := "--dev=false"
		if dev {
			flag = "--dev"
		}
		t.Run(flag, func(t *testing.T) {
			base, stderr := startServe(t, "--data-dir", t.TempDir(), flag)
			resp, err := http.Get(base + "/v1/models")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			want := http.StatusUnauthorized
			if dev {
				want = http.StatusOK
			}
			if resp.StatusCode != want {
				t.Errorf("anonymous GET /v1/models: %d, want %d", resp.StatusCode, want)
			}
			warned := strings.Count(stderr.String(), `level=WARN msg="development mode:`)
			if (dev && warned != 1) || (!dev && warned != 0) {
				t.Errorf("%d development mode warnings in the log:\n%s", warned, stderr.String())
			}
		})
	}
}
