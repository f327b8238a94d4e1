package main

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestConfigReference fails when docs/configuration.md's generated
// reference differs from what the configuration struct and the settings
// table give; with KVGATE_UPDATE_DOCS=1 (make docs) it writes it.
func TestConfigReference(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	ref, err := configReference(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| `admission.max_queue_wait` |", "| `nats.tls.ca_file` |", "`--otlp-endpoint`", "`KVGATE_ADDR`",
		"| `backends[].max_num_seqs` |", "| `gateway.max_body_bytes` |  |  | whole number | `8 MiB` |", "| `admission.max_queue_wait` |  |  | duration (`30s`, `5m`) | `30s` | How long a ticket may wait"} {
		if !strings.Contains(ref, want) {
			t.Errorf("the reference lacks %q", want)
		}
	}
	pagePath := filepath.Join(root, "docs", "configuration.md")
	page, err := os.ReadFile(pagePath)
	if err != nil {
		t.Fatal(err)
	}
	want := updateReference(string(page), ref)
	if os.Getenv("KVGATE_UPDATE_DOCS") == "1" {
		if want != string(page) {
			if err := os.WriteFile(pagePath, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("wrote %s", pagePath)
		}
		return
	}
	if want != string(page) {
		t.Errorf("docs/configuration.md's reference is stale: run make docs (or KVGATE_UPDATE_DOCS=1 go test -run TestConfigReference ./cmd/kvgate/)")
	}
}

// TestConfigReferenceRobust: a configuration with keys of any kind (a map
// of sections, an interface, a field without a comment or a known source)
// renders without failing.
func TestConfigReferenceRobust(t *testing.T) {
	type price struct {
		Input  float64 `yaml:"input"` // per million tokens
		Output float64 `yaml:"output"`
	}
	type extra struct {
		Aliases map[string]string `yaml:"aliases"`
		Prices  map[string]price  `yaml:"prices"`
		Any     any               `yaml:"any"`
		Inline  struct {
			X int `yaml:"x"`
		} `yaml:",inline"`
		Skip int `yaml:"-"`
	}
	root, _ := filepath.Abs("../..")
	src, err := newSourceIndex(root)
	if err != nil {
		t.Fatal(err)
	}
	var rows []docRow
	walkConfig(src, reflectTypeOf[extra](), nil, reflectValueOf(extra{}), "", &rows)
	var paths []string
	for _, r := range rows {
		paths = append(paths, r.path+":"+r.form)
	}
	got := strings.Join(paths, " ")
	for _, want := range []string{"aliases:mapping of text", "prices:mapping of section", "prices.NAME.input:number", "any:value", "x:whole number"} {
		if !strings.Contains(got, want) {
			t.Errorf("rows %s lack %s", got, want)
		}
	}
	if strings.Contains(got, "skip") {
		t.Errorf("a yaml:\"-\" field rendered: %s", got)
	}
}

func reflectTypeOf[T any]() reflect.Type { return reflect.TypeFor[T]() }
func reflectValueOf(v any) reflect.Value { return reflect.ValueOf(v) }
