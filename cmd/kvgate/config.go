package main

//go:generate env KVGATE_UPDATE_DOCS=1 go test -count=1 -run ^TestConfigReference$ .

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// config is kvgate serve's configuration: defaults, then the YAML file,
// then KVGATE_* environment variables, then flags. docs/configuration.md's
// reference is generated from it (TestConfigReference, make docs): a
// field's doc or line comment is its description, a default in [brackets]
// names what the code applies when the field is left zero, and a row in
// settings below gives it an environment variable and a flag.
type config struct {
	Addr      string              `yaml:"addr"`       // address to serve the API on
	Store     string              `yaml:"store"`      // job store: postgres://... (pgx's sslmode, sslrootcert, sslcert, sslkey apply) or sqlite://PATH [SQLite at data_dir/kvgate.db]
	DataDir   string              `yaml:"data_dir"`   // the embedded store and NATS server keep their files here; one kvgate serve at a time
	NoMigrate bool                `yaml:"no_migrate"` // do not apply the store's migrations on start, and refuse a store that lacks any (kvgate migrate applies them)
	Backends  []gpu.BackendConfig `yaml:"backends"`   // vLLM servers [none: simulated ones, see sim]
	APIKeys   []apiKey            `yaml:"api_keys"`   // static bearer keys; with none (static or in the store) every /v1/ call gets 401 outside dev
	LogLevel  string              `yaml:"log_level"`  // debug, info, warn or error
	LogFormat string              `yaml:"log_format"` // text, or json: slog's JSON handler, one object a line
	AccessLog string              `yaml:"access_log"` // the level of the access log's line per request: debug, info or off
	Tracing   struct {
		OTLPEndpoint string   `yaml:"otlp_endpoint"` // OTLP/HTTP collector URL, e.g. http://collector:4318 (/v1/traces is added); empty: tracing off
		SampleRatio  *float64 `yaml:"sample_ratio"`  // share of new traces kept; a caller's traceparent decides for its own [1]
		ServiceName  string   `yaml:"service_name"`  // the spans' service.name
	} `yaml:"tracing"`
	// Console is the operator console at /console (docs/console.md).
	Console struct {
		SessionSecret string        `yaml:"session_secret"` // seals the console's session cookies: replicas that share it share sessions; empty: each replica draws its own, and sessions are per replica
		SessionTTL    time.Duration `yaml:"session_ttl"`    // how long a console session lasts [8h]
		SecureCookies bool          `yaml:"secure_cookies"` // mark the console's cookies Secure on every request: set it behind a proxy that ends TLS (kvgate sees plain HTTP there) [only on kvgate's own HTTPS]
	} `yaml:"console"`
	// DrainTimeout bounds the drain at shutdown: how long requests,
	// streams and jobs in flight may take to finish once kvgate stops
	// taking new ones; positive.
	DrainTimeout time.Duration `yaml:"drain_timeout"`
	// DrainUnreadyDelay is how long /readyz fails, at shutdown, before
	// new requests are refused: a load balancer's time to see it and move
	// away [1s, or a quarter of a shorter drain_timeout; 0: refuse at
	// once].
	DrainUnreadyDelay *time.Duration `yaml:"drain_unready_delay"`

	// Dev is development mode: a caller without a key is tenant
	// "default"'s admin until the first key exists. Never in production.
	Dev bool `yaml:"dev"`
	// AdminKey is a bootstrap administrator's bearer token (tenant
	// "admin"): it manages tenants and keys over /v1/admin/.
	AdminKey string `yaml:"admin_key"`
	// Quotas: store-backed tenants' limits.
	Quotas struct {
		FailOpen bool          `yaml:"fail_open"` // admit when the limiter state is unreachable [false: answer 503]
		CacheTTL time.Duration `yaml:"cache_ttl"` // key and limit cache: how fast revocations spread, at most 10m [5s]
	} `yaml:"quotas"`

	Admission scheduler.Policy `yaml:"admission"` // admission thresholds (docs/admission.md)
	Gateway   struct {
		MaxBodyBytes      int64         `yaml:"max_body_bytes"`      // request bodies larger get 413, in bytes [8 MiB]
		MaxAnswerBytes    int64         `yaml:"max_answer_bytes"`    // a backend's answer to a request that is not streamed, read whole, may be at most this; a larger one is a 502 answer_too_large, in bytes [256 MiB]
		TenantFileBytes   int64         `yaml:"tenant_file_bytes"`   // what one tenant's files (uploads, batch outputs) may hold together, in bytes; an upload past it is refused [100 GiB]
		DefaultMaxTokens  int           `yaml:"default_max_tokens"`  // output reserved for a chat request without max_tokens, in tokens [1024]
		TokenCount        string        `yaml:"token_count"`         // estimate (bytes times a learned ratio) or tokenize (ask the backend: exact, one more round trip) [estimate]
		Retries           *int          `yaml:"retries"`             // other backends a request may be retried on before its first byte [1]
		StreamIdleTimeout time.Duration `yaml:"stream_idle_timeout"` // a stream whose backend sends nothing this long is cut; a client that accepts no byte of its answer, or of an event stream, this long is let go of (499), its backend not blamed [2m]
		RequestTimeout    time.Duration `yaml:"request_timeout"`     // a non-streaming request whose backend has not answered in this long fails [10m]
	} `yaml:"gateway"`
	Metrics struct {
		ScrapeInterval  time.Duration `yaml:"scrape_interval"`  // backends' /metrics period [100ms]
		StaleAfter      time.Duration `yaml:"stale_after"`      // a backend's metrics older than this count as saturated; longer than scrape_interval [1s]
		ProbeInterval   time.Duration `yaml:"probe_interval"`   // backends' /health period [1s]
		BacklogInterval time.Duration `yaml:"backlog_interval"` // how often the durable backlog, outbox age and broker lag are read for /metrics [5s]
	} `yaml:"metrics"`
	NVML struct {
		Disabled bool          `yaml:"disabled"` // do not read GPUs through NVML
		Interval time.Duration `yaml:"interval"` // GPU health period [2s]
	} `yaml:"nvml"`
	NATS struct {
		URL      string `yaml:"url"`      // external server or cluster (nats:// or tls://); empty: embedded in-process, files under data_dir
		Replicas int    `yaml:"replicas"` // stream replicas on a cluster; more than 1 needs url [1]
		// Credentials, one kind at most: user and password (or in the
		// URL), a token, an NKey seed file or a .creds file (JWT and seed).
		User         string `yaml:"user"`           // with password
		Password     string `yaml:"password"`       // of user
		Token        string `yaml:"token"`          // an authorization token
		NKeySeedFile string `yaml:"nkey_seed_file"` // file holding a user NKey's seed (SU...)
		CredsFile    string `yaml:"creds_file"`     // a .creds file: the user's JWT and NKey seed (decentralised auth)
		TLS          struct {
			CAFile     string `yaml:"ca_file"`     // PEM CA that signed the servers' certificates [the system's roots]
			CertFile   string `yaml:"cert_file"`   // PEM client certificate, for servers that verify clients
			KeyFile    string `yaml:"key_file"`    // its key
			ServerName string `yaml:"server_name"` // name to verify in the server's certificate [the URL's host]
		} `yaml:"tls"`
	} `yaml:"nats"`
	// TLS serves the API over HTTPS (HTTP/2 included): a PEM certificate
	// (chain) and key, loaded again on SIGHUP and when either file changes.
	TLS struct {
		CertFile string `yaml:"cert_file"` // PEM certificate chain, the server's first
		KeyFile  string `yaml:"key_file"`  // PEM private key
	} `yaml:"tls"`
	Jobs struct {
		Concurrency     int           `yaml:"concurrency"`      // jobs run at once by this process [64]
		Lease           time.Duration `yaml:"lease"`            // claim lease, renewed every third of it [1m]
		MaxAttempts     int           `yaml:"max_attempts"`     // attempts a job may spend [5]
		DefaultDeadline time.Duration `yaml:"default_deadline"` // deadline of a job that sets none; at most 7 days, the latest a job may ask for [24h]
		Retention       time.Duration `yaml:"retention"`        // final jobs, their results, attempts and audit records are pruned this long after they ended [720h]
	} `yaml:"jobs"`
	// Webhooks are signed deliveries of job events to tenant-registered
	// endpoints (docs/webhooks.md).
	Webhooks struct {
		AllowCIDRs    []string        `yaml:"allow_cidrs"`    // address ranges deliveries may reach although refused by default (loopback, RFC 1918, link-local, ...), e.g. 10.0.0.0/8
		AllowHTTP     bool            `yaml:"allow_http"`     // permit plain http endpoint URLs [false: https only]
		RetrySchedule []time.Duration `yaml:"retry_schedule"` // wait before each attempt: the first entry 0 (the first attempt goes when the event is written), then before each retry; a delivery FAILS after the last [0, 5s, 5m, 30m, 2h, 5h, 10h, 14h, 20h, 24h]
		Timeout       time.Duration   `yaml:"timeout"`        // each attempt's whole deadline [15s]
		Concurrency   int             `yaml:"concurrency"`    // deliveries sent at once by this process; one endpoint gets a quarter of them at most, one tenant's endpoints half [64]
	} `yaml:"webhooks"`
	// Models maps model aliases to a model or an ordered list of models
	// (fallbacks); Prices are per model (and alias), per million tokens,
	// in Currency: see docs/api.md.
	Models   map[string]modelList     `yaml:"models"`
	Prices   map[string]gateway.Price `yaml:"prices"`
	Currency string                   `yaml:"currency"`
	// Sim is the development fleet started when no backend is configured.
	Sim struct {
		Profile string  `yaml:"profile"` // simulator profile (kvgate sim profiles)
		Count   int     `yaml:"count"`   // simulated backends
		Speedup float64 `yaml:"speedup"` // speed-up of simulated time; 0: as fast as it goes
	} `yaml:"sim"`
}

// defaultConfig is the configuration before the file, the environment and
// the flags.
func defaultConfig() *config {
	cfg := &config{Addr: "127.0.0.1:8080", LogLevel: "info", LogFormat: "text", AccessLog: "debug", DataDir: "data", DrainTimeout: 60 * time.Second}
	cfg.Tracing.ServiceName = "kvgate"
	cfg.Sim.Profile, cfg.Sim.Count, cfg.Sim.Speedup = "h100-llama-3.1-8b", 2, 1
	return cfg
}

type apiKey struct {
	Key    string `yaml:"key"`    // the bearer token
	Tenant string `yaml:"tenant"` // whose key it is
	Role   string `yaml:"role"`   // user, or operator: also sees retry details [user]
}

// setting gives a YAML key an environment variable and a flag of kvgate
// serve (and gpus); either may be empty. Values are parsed by the field's
// type (a duration, a number, true or false, text), or by parse.
type setting struct {
	path  string // the YAML key, e.g. "nats.url"
	env   string
	flag  string
	usage string // the flag's help; the default is added
	// parse, when set, sets the value from the environment's text or the
	// flag's (list holds a repeated flag's values).
	parse func(c *config, list []string) error
	// list marks a repeatable flag (and a comma-separated variable).
	list bool
}

// settings are the environment variables and flags, one row each.
var settings = []setting{
	{path: "addr", env: "KVGATE_ADDR", flag: "addr", usage: "address to serve the API on"},
	{path: "backends", env: "KVGATE_BACKENDS", flag: "backend", list: true, parse: parseBackendURLs,
		usage: "vLLM server base URL, repeatable (env: comma-separated); replaces the file's backends"},
	{path: "api_keys", env: "KVGATE_API_KEYS", flag: "api-key", list: true, parse: parseKeysSetting,
		usage: "TOKEN=TENANT, or TOKEN=TENANT:operator for a key that also sees retry details; repeatable (env: comma-separated)"},
	{path: "log_level", env: "KVGATE_LOG_LEVEL", flag: "log-level", usage: "debug, info, warn or error"},
	{path: "log_format", env: "KVGATE_LOG_FORMAT", flag: "log-format", usage: "text or json (slog's JSON handler, one object a line)"},
	{path: "console.session_secret", env: "KVGATE_CONSOLE_SESSION_SECRET", usage: "seals the console's session cookies; replicas that share it share sessions"},
	{path: "access_log", env: "KVGATE_ACCESS_LOG", flag: "access-log", usage: "level of the access log's line per request: debug, info or off"},
	{path: "tracing.otlp_endpoint", env: "KVGATE_OTLP_ENDPOINT", flag: "otlp-endpoint", usage: "OTLP/HTTP collector URL for traces, e.g. http://127.0.0.1:4318; empty: tracing off"},
	{path: "admission.kv_target", env: "KVGATE_KV_TARGET", flag: "kv-target", usage: "share of each backend's KV cache admitted work may fill (0.95)"},
	{path: "sim.count", flag: "sim-count", usage: "simulated backends to start when none is configured"},
	{path: "sim.profile", flag: "sim-profile", usage: "profile of the simulated backends"},
	{path: "sim.speedup", flag: "sim-speedup", usage: "speed-up of the simulated backends"},
	{path: "nvml.disabled", flag: "no-nvml", usage: "do not read GPUs through NVML"},
	{path: "store", env: "KVGATE_STORE", flag: "store", usage: "job store: postgres://... or sqlite://PATH (default: SQLite under --data-dir)"},
	{path: "data_dir", env: "KVGATE_DATA_DIR", flag: "data-dir", usage: "directory of the embedded store and NATS server"},
	{path: "no_migrate", flag: "no-migrate", usage: "do not apply the store's migrations on start, and refuse a store that lacks any (run kvgate migrate)"},
	{path: "admin_key", env: "KVGATE_ADMIN_KEY", flag: "admin-key", usage: "bootstrap administrator's bearer token, for /v1/admin/"},
	{path: "quotas.fail_open", env: "KVGATE_QUOTA_FAIL_OPEN", flag: "quota-fail-open", usage: "admit requests unlimited when the quota store is unreachable (default: answer 503)"},
	{path: "dev", env: "KVGATE_DEV", flag: "dev", usage: "development mode: a caller without a key is tenant default's admin until the first key exists (never in production)"},
	{path: "drain_timeout", env: "KVGATE_DRAIN_TIMEOUT", flag: "drain-timeout", usage: "at shutdown, how long requests, streams and jobs in flight may take to finish"},
	{path: "drain_unready_delay", env: "KVGATE_DRAIN_UNREADY_DELAY"},
	{path: "nats.url", env: "KVGATE_NATS_URL", flag: "nats-url", usage: "NATS server or cluster for job events, e.g. nats://host:4222 (default: embedded in-process)"},
	{path: "nats.password", env: "KVGATE_NATS_PASSWORD"},
	{path: "tls.cert_file", env: "KVGATE_TLS_CERT_FILE", flag: "tls-cert", usage: "PEM certificate (chain) to serve HTTPS with, reloaded on SIGHUP or change"},
	{path: "tls.key_file", env: "KVGATE_TLS_KEY_FILE", flag: "tls-key", usage: "PEM private key of --tls-cert"},
}

func parseBackendURLs(c *config, list []string) error {
	c.Backends = nil
	for _, u := range list {
		c.Backends = append(c.Backends, gpu.BackendConfig{URL: u})
	}
	return nil
}

func parseKeysSetting(c *config, list []string) error {
	keys, err := parseKeys(list)
	if err != nil {
		return err
	}
	c.APIKeys = keys
	return nil
}

// rawFlag keeps a flag's text (every value, for a repeatable one) until
// load applies it.
type rawFlag struct {
	vals   []string
	isBool bool
	list   bool
}

func (f *rawFlag) String() string { return strings.Join(f.vals, ",") }
func (f *rawFlag) Set(v string) error {
	if f.isBool {
		if _, err := strconv.ParseBool(v); err != nil {
			return errors.New("write true or false")
		}
	}
	if f.list {
		f.vals = append(f.vals, v)
	} else {
		f.vals = []string{v}
	}
	return nil
}
func (f *rawFlag) IsBoolFlag() bool { return f.isBool }

// configFlags are the flags serve and gpus share.
type configFlags struct {
	file  string
	flags map[string]*rawFlag // by flag name
	// notices are load's warnings, for the log once it exists.
	notices []string
}

func (c *configFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.file, "config", "", "YAML configuration file (env KVGATE_CONFIG)")
	c.flags = map[string]*rawFlag{}
	def := defaultConfig()
	for _, s := range settings {
		if s.flag == "" {
			continue
		}
		v, _, err := fieldByPath(reflect.ValueOf(def).Elem(), s.path)
		if err != nil {
			panic(fmt.Sprintf("setting %s: %v", s.path, err)) // a row naming no field: TestSettingsNameFields
		}
		f := &rawFlag{isBool: v.Kind() == reflect.Bool, list: s.list}
		c.flags[s.flag] = f
		usage := s.usage
		if s.env != "" {
			usage += " (env " + s.env + ")"
		}
		if d := defaultText(v); d != "" && !f.isBool {
			usage += " [" + d + "]"
		}
		fs.Var(f, s.flag, usage)
	}
}

// load builds the configuration from the file, the environment and the
// flags that were set on fs.
func (c *configFlags) load(fs *flag.FlagSet, getenv func(string) string) (*config, error) {
	cfg := defaultConfig()
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	file := c.file
	if !set["config"] {
		file = getenv("KVGATE_CONFIG")
	}
	if file != "" {
		if err := loadYAMLFile(file, cfg); err != nil {
			return nil, err
		}
	}
	root := reflect.ValueOf(cfg).Elem()
	// A list the environment or a flag sets replaces the file's whole
	// list, what its entries say beyond a URL or a key included: said
	// once at start, since a file edited beside an environment that
	// always sets the list (a compose project's) would be ignored unseen.
	c.notices = nil
	replaced := map[string]bool{}
	replaces := func(s setting, by string) {
		if replaced[s.path] {
			return
		}
		replaced[s.path] = true
		if v, _, err := fieldByPath(root, s.path); err == nil && v.Kind() == reflect.Slice && v.Len() > 0 {
			c.notices = append(c.notices, fmt.Sprintf("%s replaces the %d entries of %s in %s: the file's are not used", by, v.Len(), s.path, file))
		}
	}
	for _, s := range settings {
		if s.env == "" {
			continue
		}
		if v := getenv(s.env); v != "" {
			if s.list {
				replaces(s, s.env)
			}
			vals := []string{v}
			if s.list {
				vals = splitList(v)
			}
			if err := applySetting(cfg, root, s, vals); err != nil {
				return nil, fmt.Errorf("%s: %w", s.env, err)
			}
		}
	}
	for _, s := range settings {
		if s.flag == "" || !set[s.flag] {
			continue
		}
		if s.list {
			replaces(s, "--"+s.flag)
		}
		if err := applySetting(cfg, root, s, c.flags[s.flag].vals); err != nil {
			return nil, fmt.Errorf("--%s: %w", s.flag, err)
		}
	}
	if cfg.DrainTimeout <= 0 {
		return nil, fmt.Errorf("drain_timeout %s: write a positive duration such as 60s", cfg.DrainTimeout)
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
		{"jobs.default_deadline", int64(c.Jobs.DefaultDeadline), true}, {"jobs.retention", int64(c.Jobs.Retention), true},
		{"metrics.backlog_interval", int64(c.Metrics.BacklogInterval), true},
		{"gateway.max_body_bytes", c.Gateway.MaxBodyBytes, false}, {"gateway.max_answer_bytes", c.Gateway.MaxAnswerBytes, false}, {"gateway.tenant_file_bytes", c.Gateway.TenantFileBytes, false}, {"gateway.default_max_tokens", int64(c.Gateway.DefaultMaxTokens), false},
		{"nats.replicas", int64(c.NATS.Replicas), false}, {"jobs.concurrency", int64(c.Jobs.Concurrency), false},
		{"jobs.max_attempts", int64(c.Jobs.MaxAttempts), false}, {"sim.count", int64(c.Sim.Count), false},
		{"webhooks.timeout", int64(c.Webhooks.Timeout), true}, {"webhooks.concurrency", int64(c.Webhooks.Concurrency), false},
	}
	for i, d := range c.Webhooks.RetrySchedule {
		numbers = append(numbers, number{fmt.Sprintf("webhooks.retry_schedule[%d]", i), int64(d), true})
	}
	if c.NATS.URL == "" && c.NATS.Replicas > 1 {
		return fmt.Errorf("nats.replicas %d needs a NATS cluster: nats.url is empty, and the embedded server keeps one copy (set nats.url, KVGATE_NATS_URL, or replicas 1)", c.NATS.Replicas)
	}
	if err := (gateway.Jobs{DefaultDeadline: c.Jobs.DefaultDeadline}).Check(); err != nil {
		return fmt.Errorf("jobs.%w", err)
	}
	if err := gateway.CheckCacheTTL(c.Quotas.CacheTTL); err != nil {
		return fmt.Errorf("quotas.%w", err)
	}
	if len(c.Webhooks.RetrySchedule) > 0 {
		if err := gateway.CheckRetrySchedule(c.Webhooks.RetrySchedule); err != nil {
			return fmt.Errorf("webhooks.retry_schedule: %w", err)
		}
	}
	if _, err := c.webhookGuard(); err != nil {
		return err
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
	if err := (gpu.PoolConfig{ScrapeInterval: c.Metrics.ScrapeInterval, StaleAfter: c.Metrics.StaleAfter}).Check(); err != nil {
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
	if c.Console.SessionTTL < 0 {
		return fmt.Errorf("console.session_ttl %s: write a positive duration, or leave it out for 8h", c.Console.SessionTTL)
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
	for i, kv := range list {
		k, t, ok := strings.Cut(kv, "=")
		if !ok || k == "" || t == "" {
			// By place, not by value: the entry is likely a key whose
			// tenant was forgotten, and errors reach logs.
			return nil, fmt.Errorf("API key entry %d of %d is not TOKEN=TENANT or TOKEN=TENANT:operator", i+1, len(list))
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
