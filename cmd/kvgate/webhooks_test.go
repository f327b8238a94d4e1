package main

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestWebhooksConfig: the webhooks section reads a schedule of durations
// and CIDR ranges, and refuses a range that is not one, or a negative
// wait, before anything starts.
func TestWebhooksConfig(t *testing.T) {
	file := filepath.Join(t.TempDir(), "kvgate.yaml")
	write := func(s string) {
		if err := os.WriteFile(file, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("webhooks:\n  allow_cidrs: [127.0.0.0/8, 10.1.2.3/8]\n  allow_http: true\n  retry_schedule: [0s, 5ms, 1m]\n  timeout: 2s\n  concurrency: 8\n")
	cfg, err := loadConfig(t, []string{"--config", file}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.Webhooks.RetrySchedule, []time.Duration{0, 5 * time.Millisecond, time.Minute}) || cfg.Webhooks.Timeout != 2*time.Second ||
		cfg.Webhooks.Concurrency != 8 || !cfg.Webhooks.AllowHTTP {
		t.Errorf("webhooks %+v", cfg.Webhooks)
	}
	g, err := cfg.webhookGuard()
	if err != nil || !slices.Equal(g.AllowCIDRs, []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.0.0.0/8")}) || !g.AllowHTTP {
		t.Errorf("guard %+v, %v", g, err)
	}
	for yaml, want := range map[string]string{
		"webhooks:\n  allow_cidrs: [localhost]\n":  "webhooks.allow_cidrs[0]",
		"webhooks:\n  retry_schedule: [0s, -1s]\n": "webhooks.retry_schedule[1]",
		"webhooks:\n  retry_schedule: [1s, 1m]\n":  "first entry (1s) must be 0",
		"webhooks:\n  timeout: -1s\n":              "webhooks.timeout",
	} {
		write(yaml)
		cfg, err := loadConfig(t, []string{"--config", file}, nil)
		if err == nil {
			err = cfg.validate()
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error naming %s", yaml, err, want)
		}
	}
}
