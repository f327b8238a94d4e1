package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestConfigModelsAndPrices: models (an alias naming one model or an
// ordered list), prices and currency load from the file; a price of an
// unknown shape is refused by name.
func TestConfigModelsAndPrices(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "kvgate.yaml")
	yaml := `models:
  gpt-4o-mini: meta-llama/Llama-3.1-8B-Instruct
  gpt-4o: [meta-llama/Llama-3.1-70B-Instruct, meta-llama/Llama-3.1-8B-Instruct]
prices:
  meta-llama/Llama-3.1-8B-Instruct: {prompt: 0.15, completion: 0.6}
currency: EUR
`
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadConfig(t, []string{"--config", file}, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := cfg.aliases()
	if !slices.Equal(a["gpt-4o-mini"], []string{"meta-llama/Llama-3.1-8B-Instruct"}) ||
		!slices.Equal(a["gpt-4o"], []string{"meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"}) {
		t.Errorf("aliases: %v", a)
	}
	if p := cfg.Prices["meta-llama/Llama-3.1-8B-Instruct"]; p.Prompt != 0.15 || p.Completion != 0.6 || cfg.Currency != "EUR" {
		t.Errorf("prices: %+v %q", cfg.Prices, cfg.Currency)
	}
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("prices:\n  m: {input: 1}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadConfig(t, []string{"--config", bad}, nil); err == nil || !strings.Contains(err.Error(), "input") {
		t.Errorf("an unknown price field: %v", err)
	}
	if err := os.WriteFile(bad, []byte("models:\n  a: {b: c}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadConfig(t, []string{"--config", bad}, nil); err == nil {
		t.Error("an alias that is a mapping was accepted")
	}
}
