// Package deploy holds the tests of kvgate's deployment files: the
// Dockerfile, the compose project, the Helm chart, the systemd units, the
// Grafana dashboard and the Prometheus rules. It is a module of its own so
// that helm, k8s.io and buildkit never become dependencies of kvgate.
package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// repoRoot is the kvgate repository, the parent of this module.
func repoRoot(t testing.TB) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "cmd", "kvgate")); err != nil {
		t.Fatalf("repository root %s: %v", root, err)
	}
	return root
}

func goCmd() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return "/usr/local/go/bin/go" // where CI's Go lives
}

// inCI reports whether a missing tool must fail the test rather than skip
// it: .ci/run installs every tool these tests use.
func inCI() bool { return os.Getenv("CI") == "true" }

// needTool returns the path of a tool, or skips (fails in CI) naming the
// Debian package that provides it.
func needTool(t testing.TB, name, debPackage string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		msg := name + " not found: install Debian's " + debPackage + " package (.ci/run does)"
		if inCI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return p
}

var (
	kvgateOnce sync.Once
	kvgateBin  string
	kvgateErr  error
	kvgateOut  []byte
)

// kvgateBinary builds kvgate once for the package's tests.
func kvgateBinary(t testing.TB) string {
	t.Helper()
	root := repoRoot(t)
	kvgateOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kvgate-deploy-bin-")
		if err != nil {
			kvgateErr = err
			return
		}
		kvgateBin = filepath.Join(dir, "kvgate")
		cmd := exec.Command(goCmd(), "build", "-o", kvgateBin, "./cmd/kvgate")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_CFLAGS=-O2 -g -Wno-deprecated-declarations")
		kvgateOut, kvgateErr = cmd.CombinedOutput()
	})
	if kvgateErr != nil {
		t.Fatalf("go build ./cmd/kvgate: %v\n%s", kvgateErr, kvgateOut)
	}
	return kvgateBin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if kvgateBin != "" {
		os.RemoveAll(filepath.Dir(kvgateBin))
	}
	os.Exit(code)
}

// contains fails unless s has every one of wants.
func contains(t *testing.T, what, s string, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !strings.Contains(s, w) {
			t.Errorf("%s lacks %q", what, w)
		}
	}
}
