package main

import (
	"errors"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/gpu"
)

// Stamped at link time by the Makefile and the Dockerfile:
//
//	go build -ldflags "-X main.stampVersion=v1.2.3 -X main.stampCommit=$(git rev-parse HEAD)"
//
// Unstamped (go build, go install, go run), the module version and the VCS
// revision the Go toolchain records stand in.
var (
	stampVersion string
	stampCommit  string
)

// buildInfo is what kvgate version prints and kvgate_build_info exposes.
type buildInfo struct {
	Version   string // a release tag or git describe; "(devel)" when unknown
	Commit    string // the full revision, "-dirty" appended for a modified tree; "unknown" when unknown
	GoVersion string
	Platform  string // GOOS/GOARCH
	NVML      bool   // built with cgo, so NVML can be loaded at run time
}

// readBuildInfo prefers the link-time stamps, then the toolchain's record.
func readBuildInfo() buildInfo {
	b := buildInfo{
		Version:   stampVersion,
		Commit:    stampCommit,
		GoVersion: runtime.Version(),
		Platform:  runtime.GOOS + "/" + runtime.GOARCH,
		NVML:      gpu.NVMLBuilt,
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		if b.Version == "" {
			b.Version = info.Main.Version
		}
		if b.Commit == "" {
			rev, dirty := "", false
			for _, s := range info.Settings {
				switch s.Key {
				case "vcs.revision":
					rev = s.Value
				case "vcs.modified":
					dirty = s.Value == "true"
				}
			}
			if rev != "" && dirty {
				rev += "-dirty"
			}
			b.Commit = rev
		}
	}
	if b.Version == "" {
		b.Version = "(devel)"
	}
	if b.Commit == "" {
		b.Commit = "unknown"
	}
	return b
}

// runVersion prints the version, the commit, the Go version, the platform
// and whether this build can use NVML.
func runVersion(args []string, stdout io.Writer) error {
	if len(args) > 0 {
		return errors.New("version takes no arguments: kvgate version")
	}
	b := readBuildInfo()
	nvml := "yes (cgo build; loaded at run time where the driver is installed)"
	if !b.NVML {
		nvml = "no (built without cgo: GPUs are not read, backends' metrics only)"
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "kvgate %s\n", b.Version)
	fmt.Fprintf(&sb, "commit:   %s\n", b.Commit)
	fmt.Fprintf(&sb, "go:       %s\n", b.GoVersion)
	fmt.Fprintf(&sb, "platform: %s\n", b.Platform)
	fmt.Fprintf(&sb, "nvml:     %s\n", nvml)
	_, err := io.WriteString(stdout, sb.String())
	return err
}

// buildInfoCollector is kvgate_build_info{version,commit,goversion}, always
// 1, the usual way to join a build's identity onto other series.
func buildInfoCollector() prometheus.Collector {
	b := readBuildInfo()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "kvgate_build_info",
		Help:        "Always 1; the labels name the running build: version, commit and Go version.",
		ConstLabels: prometheus.Labels{"version": b.Version, "commit": b.Commit, "goversion": b.GoVersion},
	})
	g.Set(1)
	return g
}
