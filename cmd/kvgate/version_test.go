package main

import (
	"debug/elf"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/gpu"
)

// withStamps sets the link-time stamps for one test.
func withStamps(t *testing.T, version, commit string) {
	t.Helper()
	oldV, oldC := stampVersion, stampCommit
	stampVersion, stampCommit = version, commit
	t.Cleanup(func() { stampVersion, stampCommit = oldV, oldC })
}

func TestVersionPrintsStamps(t *testing.T) {
	withStamps(t, "v1.2.3", "0123456789abcdef0123456789abcdef01234567")
	var out strings.Builder
	if err := runVersion(nil, &out); err != nil {
		t.Fatal(err)
	}
	nvml := "nvml:     no (built without cgo"
	if gpu.NVMLBuilt {
		nvml = "nvml:     yes (cgo build"
	}
	for _, want := range []string{
		"kvgate v1.2.3\n",
		"commit:   0123456789abcdef0123456789abcdef01234567\n",
		"go:       " + runtime.Version() + "\n",
		"platform: " + runtime.GOOS + "/" + runtime.GOARCH + "\n",
		nvml,
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("kvgate version lacks %q:\n%s", want, out.String())
		}
	}
	if err := runVersion([]string{"extra"}, &out); err == nil {
		t.Error("kvgate version extra: no error")
	}
}

func TestVersionUnstamped(t *testing.T) {
	withStamps(t, "", "")
	b := readBuildInfo()
	// A test binary has no module version and no VCS stamp of its own.
	if b.Version == "" || b.Commit == "" {
		t.Errorf("unstamped build info has empty fields: %+v", b)
	}
	if b.GoVersion != runtime.Version() {
		t.Errorf("go version %q, want %q", b.GoVersion, runtime.Version())
	}
}

func TestBuildInfoMetric(t *testing.T) {
	withStamps(t, "v1.2.3", "abc123")
	reg := prometheus.NewRegistry()
	reg.MustRegister(buildInfoCollector())
	want := `
# HELP kvgate_build_info Always 1; the labels name the running build: version, commit and Go version.
# TYPE kvgate_build_info gauge
kvgate_build_info{commit="abc123",goversion="` + runtime.Version() + `",version="v1.2.3"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvgate_build_info"); err != nil {
		t.Error(err)
	}
}

// TestServeAnswersItsStamp: GET /version under serve answers the build's
// stamped version, as `kvgate version` and kvgate_build_info do (an image
// built from a tree without .git has no other).
func TestServeAnswersItsStamp(t *testing.T) {
	withStamps(t, "v1.2.3-stamped", "abc123")
	base, _ := startServe(t, "--data-dir", t.TempDir())
	resp, err := http.Get(base + "/version")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v struct{ Version string }
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil || v.Version != "v1.2.3-stamped" {
		t.Errorf("GET /version: %+v, %v; want the stamp", v, err)
	}
}

// TestBuildWithoutCgo builds kvgate as the static image does, with
// CGO_ENABLED=0 and the Makefile's -ldflags stamps, then runs the binary:
// it must be statically linked (no ELF interpreter), print the stamps, and
// say NVML is not in the build.
func TestBuildWithoutCgo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvgate: not in -short")
	}
	goCmd, err := exec.LookPath("go")
	if err != nil {
		goCmd = "/usr/local/go/bin/go" // where CI's Go lives
	}
	bin := filepath.Join(t.TempDir(), "kvgate")
	build := exec.Command(goCmd, "build", "-trimpath", "-o", bin,
		"-ldflags", "-s -w -X main.stampVersion=v0.0.0-nocgo-test -X main.stampCommit=feedface",
		"github.com/kvgate/kvgate/cmd/kvgate")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("CGO_ENABLED=0 go build ./cmd/kvgate: %v\n%s", err, out)
	}
	if runtime.GOOS == "linux" {
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				t.Error("the CGO_ENABLED=0 binary has an ELF interpreter: it is dynamically linked")
			}
		}
		f.Close()
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("kvgate version: %v\n%s", err, out)
	}
	for _, want := range []string{"kvgate v0.0.0-nocgo-test\n", "commit:   feedface\n", "nvml:     no (built without cgo"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("kvgate version lacks %q:\n%s", want, out)
		}
	}
	// kvgate gpus reads NVML: without cgo it runs and says why NVML is off.
	out, err = exec.Command(bin, "gpus", "--log-level", "info").CombinedOutput()
	if err != nil {
		t.Fatalf("kvgate gpus: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "built without cgo") || !strings.Contains(string(out), "NVML is not available") {
		t.Errorf("kvgate gpus without cgo does not say NVML is off and why:\n%s", out)
	}
}
