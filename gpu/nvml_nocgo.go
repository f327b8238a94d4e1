//go:build !cgo

package gpu

import (
	"context"
	"log/slog"
)

// NVML is NVIDIA's management library as a build without cgo has it: never
// there. go-nvml loads libnvidia-ml through cgo, so a binary built with
// CGO_ENABLED=0 (the static image, a laptop without gcc) reports NVML off
// and runs on the backends' own metrics alone, as on a machine without
// GPUs. The release image for GPU nodes is built with cgo.
type NVML struct{}

// nvmlOffReason is why OpenNVML reports NVML off in this build.
const nvmlOffReason = "built without cgo: NVML needs a cgo build (CGO_ENABLED=1)"

// OpenNVML returns a disabled *NVML and logs one info line saying why. lib
// is ignored: this build has no NVML library to accept (callers pass nil).
func OpenNVML(lib any, cfg NVMLConfig) *NVML {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log.With("component", "nvml").Info("nvml off", "reason", nvmlOffReason)
	return &NVML{}
}

// Enabled reports false: this build has no NVML.
func (n *NVML) Enabled() bool { return false }

// Driver returns "".
func (n *NVML) Driver() string { return "" }

// GPUs returns nil.
func (n *NVML) GPUs() []GPU { return nil }

// Lookup finds nothing.
func (n *NVML) Lookup(id string) (GPU, bool) { return GPU{}, false }

// unreadable finds no GPU: there are none.
func (n *NVML) unreadable() (int, bool) { return 0, false }

// Refresh does nothing.
func (n *NVML) Refresh() {}

// Run returns ctx's error when ctx is done, as a disabled NVML's does.
func (n *NVML) Run(ctx context.Context) error {
	<-ctx.Done()
	return ctx.Err()
}

// NVMLBuilt reports whether this build can load NVML: false without cgo.
const NVMLBuilt = false
