package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
)

const dockerfile = "docker/Dockerfile"

// parseDockerfile parses the Dockerfile with BuildKit's own parser and
// linter (the code docker build runs), failing on any warning.
func parseDockerfile(t *testing.T) []instructions.Stage {
	t.Helper()
	f, err := os.Open(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := parser.Parse(f)
	if err != nil {
		t.Fatalf("parse %s: %v", dockerfile, err)
	}
	for _, w := range res.Warnings {
		t.Errorf("%s: parser warning: %s", dockerfile, w.Short)
	}
	var lints []string
	lint := linter.New(&linter.Config{Warn: func(rule, desc, url, msg string, loc []parser.Range) {
		line := 0
		if len(loc) > 0 {
			line = loc[0].Start.Line
		}
		lints = append(lints, rule+" (line "+itoa(line)+"): "+msg)
	}})
	stages, _, err := instructions.Parse(res.AST, lint)
	if err != nil {
		t.Fatalf("instructions in %s: %v", dockerfile, err)
	}
	for _, l := range lints {
		t.Errorf("%s: lint: %s", dockerfile, l)
	}
	return stages
}

func itoa(n int) string { return strconv.Itoa(n) }

func stageNamed(stages []instructions.Stage, name string) *instructions.Stage {
	for i := range stages {
		if stages[i].Name == name {
			return &stages[i]
		}
	}
	return nil
}

// TestDockerfile checks the image's shape: multi-stage, a static binary on
// distroless/static as the default target, a cgo build on distroless/base
// for GPU nodes, both running as a non-root user with kvgate as entry point,
// and every COPY --from naming an earlier stage.
func TestDockerfile(t *testing.T) {
	stages := parseDockerfile(t)
	if len(stages) < 3 {
		t.Fatalf("%d stages, want a multi-stage build", len(stages))
	}
	last := stages[len(stages)-1]
	if last.Name != "static" || !strings.HasPrefix(last.BaseName, "gcr.io/distroless/static") {
		t.Errorf("default (last) stage %q FROM %q, want static FROM gcr.io/distroless/static...", last.Name, last.BaseName)
	}
	gpu := stageNamed(stages, "gpu")
	if gpu == nil || !strings.HasPrefix(gpu.BaseName, "gcr.io/distroless/base") {
		t.Errorf("no gpu stage FROM gcr.io/distroless/base (glibc, for NVML)")
	}
	var seen []string
	for _, st := range stages {
		for _, c := range st.Commands {
			if cp, ok := c.(*instructions.CopyCommand); ok && cp.From != "" && !slices.Contains(seen, cp.From) {
				t.Errorf("stage %s: COPY --from=%s names no earlier stage", st.Name, cp.From)
			}
		}
		seen = append(seen, st.Name)
	}
	for _, name := range []string{"static", "gpu"} {
		st := stageNamed(stages, name)
		if st == nil {
			continue
		}
		var user string
		var entry []string
		for _, c := range st.Commands {
			switch c := c.(type) {
			case *instructions.UserCommand:
				user = c.User
			case *instructions.EntrypointCommand:
				entry = c.CmdLine
			}
		}
		if u, _, _ := strings.Cut(user, ":"); u == "" || u == "root" || u == "0" {
			t.Errorf("stage %s runs as %q, want a non-root user", name, user)
		}
		if len(entry) == 0 || filepath.Base(entry[0]) != "kvgate" {
			t.Errorf("stage %s: entry point %q, want kvgate", name, entry)
		}
	}
	for _, name := range []string{"build", "build-cgo"} {
		if stageNamed(stages, name) == nil {
			t.Errorf("no %s stage", name)
		}
	}
}

// imageEnv is the environment the default (last) stage of the image sets.
func imageEnv(t *testing.T) map[string]string {
	t.Helper()
	stages := parseDockerfile(t)
	env := map[string]string{}
	for _, c := range stages[len(stages)-1].Commands {
		if e, ok := c.(*instructions.EnvCommand); ok {
			for _, kv := range e.Env {
				env[kv.Key] = kv.Value
			}
		}
	}
	return env
}

// buildRun returns the shell command of the stage's RUN that builds kvgate.
func buildRun(t *testing.T, st *instructions.Stage) string {
	t.Helper()
	for _, c := range st.Commands {
		if r, ok := c.(*instructions.RunCommand); ok {
			line := strings.Join(r.CmdLine, " ")
			if strings.Contains(line, "go build") {
				return line
			}
		}
	}
	t.Fatalf("stage %s has no RUN with go build", st.Name)
	return ""
}

// TestDockerfileBuildStep runs the static stage's own build command (taken
// from the parsed Dockerfile, with /out in a temporary directory) in the
// repository: it must build without cgo, stamp the version and commit the
// build args give, and leave a statically linked binary that says NVML is
// not in the build.
func TestDockerfileBuildStep(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvgate")
	}
	st := stageNamed(parseDockerfile(t), "build")
	if st == nil {
		t.Fatal("no build stage")
	}
	line := buildRun(t, st)
	contains(t, "the build stage's RUN", line, "CGO_ENABLED=0", "-X main.stampVersion=${VERSION}", "-X main.stampCommit=${COMMIT}")
	out := t.TempDir()
	line = strings.ReplaceAll(line, "/out/", out+"/")
	cmd := exec.Command("sh", "-c", line)
	cmd.Dir = repoRoot(t)
	cmd.Env = append(os.Environ(), "VERSION=v9.8.7-docker", "COMMIT=c0ffee", "PATH="+filepath.Dir(goCmd())+":"+os.Getenv("PATH"))
	got, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the build stage's RUN: %v\n%s", err, got)
	}
	contains(t, "kvgate version from the Dockerfile's build", string(got), "kvgate v9.8.7-docker\n", "commit:   c0ffee\n", "nvml:     no")
	if fi, err := os.Stat(filepath.Join(out, "data")); err != nil || !fi.IsDir() {
		t.Errorf("the build stage leaves no data directory: %v", err)
	}
}

// TestDockerBuild builds the image with a real docker daemon where one is
// usable; without one the parse above is what is checked.
func TestDockerBuild(t *testing.T) {
	docker, err := exec.LookPath("docker")
	if err != nil {
		t.Skip("docker not installed: TestDockerfile checked the Dockerfile with BuildKit's parser")
	}
	if out, err := exec.Command(docker, "info", "--format", "{{.ServerVersion}}").CombinedOutput(); err != nil {
		t.Skipf("no docker daemon reachable (%s): TestDockerfile checked the Dockerfile with BuildKit's parser", bytes.TrimSpace(out))
	}
	if os.Getenv("KVGATE_DOCKER_BUILD") == "" {
		t.Skip("set KVGATE_DOCKER_BUILD=1 to build the image (pulls golang and distroless)")
	}
	cmd := exec.Command(docker, "build", "-f", "deploy/docker/Dockerfile", "--build-arg", "VERSION=v0.0.0-test", "-t", "kvgate:test", ".")
	cmd.Dir = repoRoot(t)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("docker build: %v\n%s", err, out)
	}
	out, err := exec.Command(docker, "run", "--rm", "kvgate:test", "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "kvgate v0.0.0-test") {
		t.Fatalf("docker run kvgate:test version: %v\n%s", err, out)
	}
}
