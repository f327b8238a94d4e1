package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestConfigBackendModels: backends[].models names a backend's models in
// the file; an empty name is refused.
func TestConfigBackendModels(t *testing.T) {
	dir := t.TempDir()
	write := func(body string) string {
		p := filepath.Join(dir, "kvgate.yaml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cfg, err := loadConfig(t, []string{"--config", write(`backends:
  - {name: gpu0, url: "http://10.0.0.5:8000", models: [meta-llama/Llama-3.1-8B-Instruct, BAAI/bge-m3]}
  - {name: gpu1, url: "http://10.0.0.6:8000"}
`)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Backends) != 2 || !slices.Equal(cfg.Backends[0].Models, []string{"meta-llama/Llama-3.1-8B-Instruct", "BAAI/bge-m3"}) ||
		cfg.Backends[1].Models != nil {
		t.Errorf("backends %+v", cfg.Backends)
	}
	_, err = loadConfig(t, []string{"--config", write(`backends:
  - {url: "http://10.0.0.5:8000", models: ["llama", " "]}
`)}, nil)
	if err == nil || !strings.Contains(err.Error(), "backends[0] (http://10.0.0.5:8000): models: an empty model name") {
		t.Errorf("an empty model name: %v", err)
	}
}
