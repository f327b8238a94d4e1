package deploy

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var units = []string{"kvgate.service", "kvgate-sim.service"}

// unitRoot lays out a file-system root for systemd-analyze --root: the
// units in /etc/systemd/system, kvgate at /usr/local/bin/kvgate (where
// ExecStart looks for it), and the distribution's own units (the targets
// every unit depends on).
func unitRoot(t *testing.T, files map[string][]byte) string {
	t.Helper()
	root := t.TempDir()
	etc := filepath.Join(root, "etc", "systemd", "system")
	bin := filepath.Join(root, "usr", "local", "bin")
	for _, d := range []string{etc, bin, filepath.Join(root, "usr", "lib", "systemd")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	kv, err := os.ReadFile(kvgateBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "kvgate"), kv, 0o755); err != nil {
		t.Fatal(err)
	}
	sys := "/usr/lib/systemd/system"
	if _, err := os.Stat(sys); err != nil {
		sys = "/lib/systemd/system"
	}
	if out, err := exec.Command("cp", "-r", sys, filepath.Join(root, "usr", "lib", "systemd", "system")).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v\n%s", sys, err, out)
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(etc, name), body, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// verify runs systemd-analyze verify on the units in root and returns what
// it said: any word from it (an unknown key, a bad value, a missing
// command) is a finding, whatever its exit status.
func verify(t *testing.T, sa, root string, names ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(sa, append([]string{"verify", "--root=" + root}, names...)...)
	out, err := cmd.CombinedOutput()
	return string(bytes.TrimSpace(out)), err
}

func readUnits(t *testing.T) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	for _, u := range units {
		b, err := os.ReadFile(filepath.Join("systemd", u))
		if err != nil {
			t.Fatal(err)
		}
		files[u] = b
	}
	return files
}

// TestSystemdUnits checks the units with systemd-analyze verify (clean:
// no output) and systemd-analyze security (exposure at most 3.0 of 10),
// and that each has the hardening and restart policy the deployment
// guide promises.
func TestSystemdUnits(t *testing.T) {
	sa := needTool(t, "systemd-analyze", "systemd")
	files := readUnits(t)
	root := unitRoot(t, files)
	if out, err := verify(t, sa, root, units...); err != nil || out != "" {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	for _, u := range units {
		out, err := exec.Command(sa, "security", "--offline=yes", "--root="+root, "--threshold=30", u).CombinedOutput()
		if err != nil {
			t.Errorf("systemd-analyze security %s: exposure above 3.0 (%v)\n%s", u, err, out)
		}
		d := directives(files[u])
		want := map[string]string{
			"ProtectSystem": "strict", "NoNewPrivileges": "yes", "Restart": "on-failure", "DynamicUser": "yes",
		}
		for k, v := range want {
			if !contains1(d[k], v) {
				t.Errorf("%s: %s=%v, want %s", u, k, d[k], v)
			}
		}
		for _, k := range []string{"StateDirectory", "EnvironmentFile", "ExecStart"} {
			if len(d[k]) == 0 {
				t.Errorf("%s has no %s", u, k)
			}
		}
	}
	// The gateway's stop timeout outlasts its default drain (60s).
	d := directives(files["kvgate.service"])
	stop, err := time.ParseDuration(strings.TrimSpace(last(d["TimeoutStopSec"])) + "s")
	if err != nil || stop <= 60*time.Second {
		t.Errorf("kvgate.service TimeoutStopSec=%v (%v): want longer than the 60s drain", d["TimeoutStopSec"], err)
	}
	if !strings.Contains(last(d["ExecStart"]), "kvgate serve") {
		t.Errorf("kvgate.service ExecStart=%v, want kvgate serve", d["ExecStart"])
	}
	// The data directory reaches serve and the commands run with the
	// environment file alike: a variable, not a flag of serve alone.
	env, err := os.ReadFile(filepath.Join("systemd", "kvgate.env"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(last(d["ExecStart"]), "--data-dir") || !strings.Contains(string(env), "\nKVGATE_DATA_DIR=/var/lib/kvgate\n") ||
		!contains1(d["Environment"], "KVGATE_DATA_DIR=/var/lib/kvgate") {
		t.Errorf("kvgate.service: ExecStart=%v Environment=%v; want the data directory as KVGATE_DATA_DIR, in the unit and its environment file", d["ExecStart"], d["Environment"])
	}
}

// TestSystemdVerifyCatches: the check above fails on a unit with a typo,
// so that its passing means something.
func TestSystemdVerifyCatches(t *testing.T) {
	sa := needTool(t, "systemd-analyze", "systemd")
	files := readUnits(t)
	files["kvgate.service"] = bytes.Replace(files["kvgate.service"], []byte("NoNewPrivileges=yes"), []byte("NoNewPrivilege=yes"), 1)
	root := unitRoot(t, files)
	if out, _ := verify(t, sa, root, "kvgate.service"); !strings.Contains(out, "NoNewPrivilege") {
		t.Errorf("systemd-analyze verify says nothing of a misspelt key: %q", out)
	}
}

// directives reads a unit file's Key=Value lines.
func directives(unit []byte) map[string][]string {
	d := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(unit))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == ';' || line[0] == '[' {
			continue
		}
		if k, v, ok := strings.Cut(line, "="); ok {
			d[k] = append(d[k], v)
		}
	}
	return d
}

func contains1(vs []string, v string) bool {
	for _, x := range vs {
		if x == v {
			return true
		}
	}
	return false
}

func last(vs []string) string {
	if len(vs) == 0 {
		return ""
	}
	return vs[len(vs)-1]
}
