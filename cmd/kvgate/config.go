package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// config is kvgate serve's configuration: defaults, then the YAML file,
// then KVGATE_* environment variables, then flags.
type config struct {
	Addr      string              `yaml:"addr"`
	Store     string              `yaml:"store"`    // postgres://... or sqlite://PATH; SQLite under DataDir by default
	DataDir   string              `yaml:"data_dir"` // the embedded store and NATS server keep their files here
	NoMigrate bool                `yaml:"no_migrate"`
	Backends  []gpu.BackendConfig `yaml:"backends"`
	APIKeys   []apiKey            `yaml:"api_keys"`
	LogLevel  string              `yaml:"log_level"`
	LogFormat string              `yaml:"log_format"` // text or json
	AccessLog string              `yaml:"access_log"` // the access log's level: debug, info or off [debug]
	Tracing   struct {
		OTLPEndpoint string   `yaml:"otlp_endpoint"` // OTLP/HTTP collector URL; empty: tracing off
		SampleRatio  *float64 `yaml:"sample_ratio"`  // of new traces (a caller's sampled traceparent is followed) [1]
		ServiceName  string   `yaml:"service_name"`  // [kvgate]
	} `yaml:"tracing"`
	// DrainTimeout bounds the drain at shutdown: how long requests,
	// streams and jobs in flight may take to finish once kvgate stops
	// taking new ones [60s].
	DrainTimeout time.Duration `yaml:"drain_timeout"`
	// DrainUnreadyDelay is how long /readyz fails, at shutdown, before
	// new requests are refused: a load balancer's time to see it and move
	// away [1s, or a quarter of a shorter drain_timeout; 0: refuse at
	// once].
	DrainUnreadyDelay *time.Duration `yaml:"drain_unready_delay"`

	// Dev is development mode: a caller without a key is tenant
	// "default"'s admin until the first key exists.
	Dev bool `yaml:"dev"`
	// AdminKey is a bootstrap administrator's bearer token (tenant
	// "admin"): it manages tenants and keys over /v1/admin/.
	AdminKey string `yaml:"admin_key"`
	// Quotas: store-backed tenants' limits.
	Quotas struct {
		FailOpen bool          `yaml:"fail_open"` // admit when the limiter state is unreachable (default: 503)
		CacheTTL time.Duration `yaml:"cache_ttl"` // key and limit cache: how fast revocations spread [5s]
	} `yaml:"quotas"`

	Admission scheduler.Policy `yaml:"admission"`
	Gateway   struct {
		MaxBodyBytes      int64         `yaml:"max_body_bytes"`
		DefaultMaxTokens  int           `yaml:"default_max_tokens"`
		TokenCount        string        `yaml:"token_count"`
		Retries           *int          `yaml:"retries"`
		StreamIdleTimeout time.Duration `yaml:"stream_idle_timeout"`
		RequestTimeout    time.Duration `yaml:"request_timeout"`
	} `yaml:"gateway"`
	Metrics struct {
		ScrapeInterval time.Duration `yaml:"scrape_interval"`
		StaleAfter     time.Duration `yaml:"stale_after"`
		ProbeInterval  time.Duration `yaml:"probe_interval"`
		// BacklogInterval is how often the durable backlog, outbox age
		// and broker lag are read for /metrics [5s].
		BacklogInterval time.Duration `yaml:"backlog_interval"`
	} `yaml:"metrics"`
	NVML struct {
		Disabled bool          `yaml:"disabled"`
		Interval time.Duration `yaml:"interval"`
	} `yaml:"nvml"`
	NATS struct {
		URL      string `yaml:"url"`      // external server or cluster; empty: embedded in-process
		Replicas int    `yaml:"replicas"` // stream replicas on a cluster [1]
		// Credentials, one kind at most: user and password (or in the
		// URL), a token, an NKey seed file or a .creds file (JWT and seed).
		User         string `yaml:"user"`
		Password     string `yaml:"password"`
		Token        string `yaml:"token"`
		NKeySeedFile string `yaml:"nkey_seed_file"`
		CredsFile    string `yaml:"creds_file"`
		TLS          struct {
			CAFile     string `yaml:"ca_file"`     // CA that signed the servers' certificates [the system's]
			CertFile   string `yaml:"cert_file"`   // client certificate, for servers that verify clients
			KeyFile    string `yaml:"key_file"`    // its key
			ServerName string `yaml:"server_name"` // name to verify [the URL's host]
		} `yaml:"tls"`
	} `yaml:"nats"`
	// TLS serves the API over HTTPS: a PEM certificate (chain) and key,
	// loaded again on SIGHUP and when either file changes.
	TLS struct {
		CertFile string `yaml:"cert_file"`
		KeyFile  string `yaml:"key_file"`
	} `yaml:"tls"`
	Jobs struct {
		Concurrency     int           `yaml:"concurrency"`
		Lease           time.Duration `yaml:"lease"`
		MaxAttempts     int           `yaml:"max_attempts"`
		DefaultDeadline time.Duration `yaml:"default_deadline"`
	} `yaml:"jobs"`
	// Sim is the development fleet started when no backend is configured.
	Sim struct {
		Profile string  `yaml:"profile"`
		Count   int     `yaml:"count"`
		Speedup float64 `yaml:"speedup"`
	} `yaml:"sim"`
}

type apiKey struct {
	Key    string `yaml:"key"`
	Tenant string `yaml:"tenant"`
	Role   string `yaml:"role"` // user (default) or operator: sees retry details
}

// repeated is a flag that may be given many times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ",") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

// configFlags are the flags serve and gpus share.
type configFlags struct {
	file     string
	addr     string
	backends repeated
	keys     repeated
	logLevel string
	logFmt   string
	access   string
	otlp     string
	tlsCert  string
	tlsKey   string
	kvTarget float64
	simCount int
	simProf  string
	speedup  float64
	noNVML   bool
	store    string
	dataDir  string
	noMig    bool
	natsURL  string
	adminKey string
	failOpen bool
	dev      bool
	drain    time.Duration
}

func (c *configFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.file, "config", "", "YAML configuration file (env KVGATE_CONFIG)")
	fs.StringVar(&c.addr, "addr", "", "address to serve the API on (env KVGATE_ADDR; default 127.0.0.1:8080)")
	fs.Var(&c.backends, "backend", "vLLM server base URL, repeatable (env KVGATE_BACKENDS, comma-separated)")
	fs.Var(&c.keys, "api-key", "TOKEN=TENANT, or TOKEN=TENANT:operator for a key that also sees retry details; repeatable (env KVGATE_API_KEYS, comma-separated); none (and no store key) means 401 for everyone, outside --dev")
	fs.StringVar(&c.logLevel, "log-level", "", "debug, info, warn or error (env KVGATE_LOG_LEVEL; default info)")
	fs.StringVar(&c.logFmt, "log-format", "", "text or json: slog's JSON handler, one object a line (env KVGATE_LOG_FORMAT; default text)")
	fs.StringVar(&c.access, "access-log", "", "level of the access log's line per request: debug, info or off (env KVGATE_ACCESS_LOG; default debug)")
	fs.StringVar(&c.otlp, "otlp-endpoint", "", "OTLP/HTTP collector URL for traces, e.g. http://127.0.0.1:4318 (env KVGATE_OTLP_ENDPOINT; default: tracing off)")
	fs.StringVar(&c.tlsCert, "tls-cert", "", "PEM certificate (chain) to serve HTTPS with, reloaded on SIGHUP or change (env KVGATE_TLS_CERT_FILE)")
	fs.StringVar(&c.tlsKey, "tls-key", "", "PEM private key of --tls-cert (env KVGATE_TLS_KEY_FILE)")
	fs.Float64Var(&c.kvTarget, "kv-target", 0, "share of each backend's KV cache admitted work may fill (env KVGATE_KV_TARGET; default 0.95)")
	fs.IntVar(&c.simCount, "sim-count", 0, "simulated backends to start when none is configured (default 2)")
	fs.StringVar(&c.simProf, "sim-profile", "", "profile of the simulated backends (default h100-llama-3.1-8b)")
	fs.Float64Var(&c.speedup, "sim-speedup", 0, "speed-up of the simulated backends (default 1)")
	fs.BoolVar(&c.noNVML, "no-nvml", false, "do not read GPUs through NVML")
	fs.StringVar(&c.store, "store", "", "job store: postgres://... or sqlite://PATH (env KVGATE_STORE; default: SQLite under --data-dir)")
	fs.StringVar(&c.dataDir, "data-dir", "", "directory of the embedded store (env KVGATE_DATA_DIR; default ./data)")
	fs.BoolVar(&c.noMig, "no-migrate", false, "do not apply the store's migrations on start (run kvgate migrate)")
	fs.StringVar(&c.adminKey, "admin-key", "", "bootstrap administrator's bearer token, for /v1/admin/ (env KVGATE_ADMIN_KEY)")
	fs.BoolVar(&c.failOpen, "quota-fail-open", false, "admit requests unlimited when the quota store is unreachable (env KVGATE_QUOTA_FAIL_OPEN; default: answer 503)")
	fs.BoolVar(&c.dev, "dev", false, "development mode: a caller without a key is tenant default's admin until the first key exists (env KVGATE_DEV; never in production)")
	fs.DurationVar(&c.drain, "drain-timeout", 0, "at shutdown, how long requests, streams and jobs in flight may take to finish (env KVGATE_DRAIN_TIMEOUT; default 60s)")
	fs.StringVar(&c.natsURL, "nats-url", "", "NATS server or cluster for job events, e.g. nats://host:4222 (env KVGATE_NATS_URL; default: embedded in-process, files under --data-dir)")
}

// load builds the configuration from the file, the environment and the
// flags that were set on fs.
func (c *configFlags) load(fs *flag.FlagSet, getenv func(string) string) (*config, error) {
	cfg := &config{Addr: "127.0.0.1:8080", LogLevel: "info", LogFormat: "text", AccessLog: "debug", DataDir: "data", DrainTimeout: 60 * time.Second}
	cfg.Tracing.ServiceName = "kvgate"
	cfg.Sim.Profile, cfg.Sim.Count, cfg.Sim.Speedup = "h100-llama-3.1-8b", 2, 1
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	file := c.file
	if !set["config"] {
		file = getenv("KVGATE_CONFIG")
	}
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("read config: %w", err)
		}
		dec := yaml.NewDecoder(strings.NewReader(string(b)))
		dec.KnownFields(true)
		if err := dec.Decode(cfg); err != nil && !errors.Is(err, io.EOF) { // EOF: an empty file
			return nil, fmt.Errorf("config %s: %w", file, err)
		}
		// Decode reads one document; what a second one sets (api_keys
		// after a "---") would be dropped without a word.
		for {
			var more yaml.Node
			err := dec.Decode(&more)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, fmt.Errorf("config %s: %w", file, err)
			}
			if len(more.Content) > 0 && more.Content[0].Tag != "!!null" {
				return nil, fmt.Errorf("config %s holds more than one YAML document; kvgate reads one", file)
			}
		}
	}

	env := func(name string) (string, bool) {
		v := getenv(name)
		return v, v != ""
	}
	if v, ok := env("KVGATE_ADDR"); ok {
		cfg.Addr = v
	}
	if v, ok := env("KVGATE_LOG_LEVEL"); ok {
		cfg.LogLevel = v
	}
	if v, ok := env("KVGATE_LOG_FORMAT"); ok {
		cfg.LogFormat = v
	}
	if v, ok := env("KVGATE_ACCESS_LOG"); ok {
		cfg.AccessLog = v
	}
	if v, ok := env("KVGATE_OTLP_ENDPOINT"); ok {
		cfg.Tracing.OTLPEndpoint = v
	}
	if v, ok := env("KVGATE_TLS_CERT_FILE"); ok {
		cfg.TLS.CertFile = v
	}
	if v, ok := env("KVGATE_TLS_KEY_FILE"); ok {
		cfg.TLS.KeyFile = v
	}
	if v, ok := env("KVGATE_NATS_PASSWORD"); ok {
		cfg.NATS.Password = v
	}
	if v, ok := env("KVGATE_STORE"); ok {
		cfg.Store = v
	}
	if v, ok := env("KVGATE_DATA_DIR"); ok {
		cfg.DataDir = v
	}
	if v, ok := env("KVGATE_ADMIN_KEY"); ok {
		cfg.AdminKey = v
	}
	if v, ok := env("KVGATE_QUOTA_FAIL_OPEN"); ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return nil, fmt.Errorf("KVGATE_QUOTA_FAIL_OPEN: %w", err)
		}
		cfg.Quotas.FailOpen = b
	}
	if v, ok := env("KVGATE_DEV"); ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return nil, fmt.Errorf("KVGATE_DEV: %w", err)
		}
		cfg.Dev = b
	}
	if v, ok := env("KVGATE_NATS_URL"); ok {
		cfg.NATS.URL = v
	}
	if v, ok := env("KVGATE_DRAIN_UNREADY_DELAY"); ok {
		d, err := time.ParseDuration(v)
		if err != nil {
			return nil, fmt.Errorf("KVGATE_DRAIN_UNREADY_DELAY: %w", err)
		}
		cfg.DrainUnreadyDelay = &d
	}
	if v, ok := env("KVGATE_DRAIN_TIMEOUT"); ok {
		d, err := time.ParseDuration(v)
		if err != nil {
			return nil, fmt.Errorf("KVGATE_DRAIN_TIMEOUT: %w", err)
		}
		cfg.DrainTimeout = d
	}
	if v, ok := env("KVGATE_BACKENDS"); ok {
		cfg.Backends = nil
		for _, u := range splitList(v) {
			cfg.Backends = append(cfg.Backends, gpu.BackendConfig{URL: u})
		}
	}
	if v, ok := env("KVGATE_API_KEYS"); ok {
		keys, err := parseKeys(splitList(v))
		if err != nil {
			return nil, fmt.Errorf("KVGATE_API_KEYS: %w", err)
		}
		cfg.APIKeys = keys
	}
	if v, ok := env("KVGATE_KV_TARGET"); ok {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return nil, fmt.Errorf("KVGATE_KV_TARGET: %w", err)
		}
		cfg.Admission.KVTarget = f
	}

	if set["addr"] {
		cfg.Addr = c.addr
	}
	if set["log-level"] {
		cfg.LogLevel = c.logLevel
	}
	if set["log-format"] {
		cfg.LogFormat = c.logFmt
	}
	if set["access-log"] {
		cfg.AccessLog = c.access
	}
	if set["otlp-endpoint"] {
		cfg.Tracing.OTLPEndpoint = c.otlp
	}
	if set["tls-cert"] {
		cfg.TLS.CertFile = c.tlsCert
	}
	if set["tls-key"] {
		cfg.TLS.KeyFile = c.tlsKey
	}
	if set["store"] {
		cfg.Store = c.store
	}
	if set["data-dir"] {
		cfg.DataDir = c.dataDir
	}
	if set["no-migrate"] {
		cfg.NoMigrate = c.noMig
	}
	if set["admin-key"] {
		cfg.AdminKey = c.adminKey
	}
	if set["quota-fail-open"] {
		cfg.Quotas.FailOpen = c.failOpen
	}
	if set["dev"] {
		cfg.Dev = c.dev
	}
	if set["nats-url"] {
		cfg.NATS.URL = c.natsURL
	}
	if set["drain-timeout"] {
		cfg.DrainTimeout = c.drain
	}
	if set["backend"] {
		cfg.Backends = nil
		for _, u := range c.backends {
			cfg.Backends = append(cfg.Backends, gpu.BackendConfig{URL: u})
		}
	}
	if set["api-key"] {
		keys, err := parseKeys(c.keys)
		if err != nil {
			return nil, fmt.Errorf("--api-key: %w", err)
		}
		cfg.APIKeys = keys
	}
	if set["kv-target"] {
		cfg.Admission.KVTarget = c.kvTarget
	}
	if set["sim-count"] {
		cfg.Sim.Count = c.simCount
	}
	if set["sim-profile"] {
		cfg.Sim.Profile = c.simProf
	}
	if set["sim-speedup"] {
		cfg.Sim.Speedup = c.speedup
	}
	if set["no-nvml"] {
		cfg.NVML.Disabled = c.noNVML
	}
	if cfg.DrainTimeout <= 0 {
		return nil, fmt.Errorf("drain timeout %s: it must be positive", cfg.DrainTimeout)
	}
	if cfg.DrainUnreadyDelay == nil {
		d := min(time.Second, cfg.DrainTimeout/4)
		cfg.DrainUnreadyDelay = &d
	}
	if d := *cfg.DrainUnreadyDelay; d < 0 || d >= cfg.DrainTimeout {
		return nil, fmt.Errorf("drain_unready_delay %s: it must be at least 0 and shorter than drain_timeout (%s)", d, cfg.DrainTimeout)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	for i, b := range cfg.Backends {
		// A backend's models (the file only) are names kvgate knows before
		// the backend answers, and the only ones it serves of it.
		for _, m := range b.Models {
			if strings.TrimSpace(m) == "" {
				return nil, fmt.Errorf("backends[%d] (%s): models: an empty model name", i, b.URL)
			}
		}
	}
	return cfg, nil
}

// validate refuses, before anything starts, a configuration that serve
// would refuse only once it had begun (its admission policy, keys,
// backends, token count or log level) or could not run: a negative
// duration or count (a ticker panics on one) or a speed-up that is not a
// finite number.
func (c *config) validate() error {
	if err := c.Admission.Validate(); err != nil {
		return fmt.Errorf("admission: %w", err)
	}
	type number struct {
		name     string
		v        int64
		duration bool
	}
	numbers := []number{
		{"quotas.cache_ttl", int64(c.Quotas.CacheTTL), true}, {"gateway.stream_idle_timeout", int64(c.Gateway.StreamIdleTimeout), true},
		{"gateway.request_timeout", int64(c.Gateway.RequestTimeout), true}, {"metrics.scrape_interval", int64(c.Metrics.ScrapeInterval), true},
		{"metrics.stale_after", int64(c.Metrics.StaleAfter), true}, {"metrics.probe_interval", int64(c.Metrics.ProbeInterval), true},
		{"nvml.interval", int64(c.NVML.Interval), true}, {"jobs.lease", int64(c.Jobs.Lease), true},
		{"jobs.default_deadline", int64(c.Jobs.DefaultDeadline), true}, {"metrics.backlog_interval", int64(c.Metrics.BacklogInterval), true},
		{"gateway.max_body_bytes", c.Gateway.MaxBodyBytes, false}, {"gateway.default_max_tokens", int64(c.Gateway.DefaultMaxTokens), false},
		{"nats.replicas", int64(c.NATS.Replicas), false}, {"jobs.concurrency", int64(c.Jobs.Concurrency), false},
		{"jobs.max_attempts", int64(c.Jobs.MaxAttempts), false}, {"sim.count", int64(c.Sim.Count), false},
	}
	if c.Gateway.Retries != nil {
		numbers = append(numbers, number{"gateway.retries", int64(*c.Gateway.Retries), false})
	}
	for i, b := range c.Backends {
		numbers = append(numbers, number{fmt.Sprintf("backends[%d].max_num_seqs", i), int64(b.MaxNumSeqs), false},
			number{fmt.Sprintf("backends[%d].capacity_tokens", i), int64(b.CapacityTokens), false})
	}
	for _, n := range numbers {
		switch {
		case n.v < 0 && n.duration:
			return fmt.Errorf("%s %s must not be negative", n.name, time.Duration(n.v))
		case n.v < 0:
			return fmt.Errorf("%s %d must not be negative", n.name, n.v)
		}
	}
	if !(c.Sim.Speedup >= 0) || math.IsInf(c.Sim.Speedup, 0) {
		return fmt.Errorf("sim.speedup %g must be a finite number >= 0", c.Sim.Speedup)
	}
	if _, _, err := c.keyMaps(); err != nil {
		return err
	}
	if len(c.Backends) > 0 {
		// The pool's own checks (URLs, duplicates); the pool starts nothing.
		if _, err := gpu.NewPool(c.Backends, gpu.PoolConfig{}); err != nil {
			return fmt.Errorf("backends: %w", err)
		}
	}
	if tc := c.Gateway.TokenCount; tc != "" && tc != "estimate" && tc != "tokenize" {
		return fmt.Errorf("gateway: token_count %q is not estimate or tokenize", tc)
	}
	if _, err := newLogger(io.Discard, c.LogLevel, c.LogFormat); err != nil {
		return err
	}
	switch c.AccessLog {
	case "", "debug", "info", "off":
	default:
		return fmt.Errorf("access_log %q: write debug, info or off", c.AccessLog)
	}
	if r := c.Tracing.SampleRatio; r != nil && !(*r >= 0 && *r <= 1) {
		return fmt.Errorf("tracing.sample_ratio %g: write a number from 0 to 1", *r)
	}
	return nil
}

func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func parseKeys(list []string) ([]apiKey, error) {
	var keys []apiKey
	for _, kv := range list {
		k, t, ok := strings.Cut(kv, "=")
		if !ok || k == "" || t == "" {
			return nil, fmt.Errorf("%q is not TOKEN=TENANT or TOKEN=TENANT:operator", kv)
		}
		role := ""
		if tenant, r, ok := strings.Cut(t, ":"); ok {
			t, role = tenant, r
		}
		keys = append(keys, apiKey{Key: k, Tenant: t, Role: role})
	}
	return keys, nil
}

// keyMaps returns the tenants of the users' keys and of the operators'.
func (c *config) keyMaps() (users, operators map[string]string, err error) {
	users, operators = map[string]string{}, map[string]string{}
	for _, k := range c.APIKeys {
		if k.Key == "" || k.Tenant == "" {
			return nil, nil, errors.New("api_keys: every key needs a key and a tenant")
		}
		if users[k.Key] != "" || operators[k.Key] != "" {
			return nil, nil, errors.New("api_keys: a key is listed twice")
		}
		switch k.Role {
		case "", "user":
			users[k.Key] = k.Tenant
		case "operator":
			operators[k.Key] = k.Tenant
		default:
			return nil, nil, fmt.Errorf("api_keys: role %q is not user or operator", k.Role)
		}
	}
	return users, operators, nil
}

// adminKeys is the bootstrap administrator's key as the gateway takes it.
func (c *config) adminKeys() map[string]string {
	if c.AdminKey == "" {
		return nil
	}
	return map[string]string{c.AdminKey: "admin"}
}

// tenants are the tenants the configuration names: the static keys'
// (and "default" in development mode), sorted, once each.
func (c *config) tenants() []string {
	seen := map[string]bool{}
	if c.Dev {
		seen["default"] = true
	}
	for _, k := range c.APIKeys {
		seen[k.Tenant] = true
	}
	return slices.Sorted(maps.Keys(seen))
}
