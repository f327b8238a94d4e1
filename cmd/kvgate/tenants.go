package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlstore"
)

const tenantsUsage = `Usage:
  kvgate tenants create NAME [limits]   add a tenant
  kvgate tenants list                   list the tenants and their limits
  kvgate tenants update NAME [limits]   change the limits given, keep the others
  kvgate tenants delete NAME            delete a tenant (its name is not given again) and revoke its keys

Limits (0: unlimited): --weight, --rpm, --tpm, --max-concurrency, --max-pending-jobs,
--max-pending-tokens, --daily-tokens, --monthly-tokens.
Every command takes --store URL (env KVGATE_STORE), --data-dir and --config FILE (env
KVGATE_CONFIG) and finds the store as serve does.
`

const keysUsage = `Usage:
  kvgate keys create --tenant NAME [--role user|operator|admin] [--name LABEL] [--rpm N] [--tpm N] [--max-concurrency N]
                                        print a new key (alone, on standard output; it is shown only once)
  kvgate keys list [--tenant NAME]      list keys (their prefixes, never the keys)
  kvgate keys revoke ID                 revoke a key
  kvgate keys rotate ID                 print a new key like ID's and revoke ID

Every command takes --store URL (env KVGATE_STORE), --data-dir and --config FILE (env
KVGATE_CONFIG) and finds the store as serve does.
`

// storeFlags are the flags migrate, tenants and keys take: the store as
// serve finds it, from --store, KVGATE_STORE, the configuration file's
// store (--config or KVGATE_CONFIG), then SQLite under the data directory
// (the same order for it), so that a command run beside serve reaches the
// store serve uses.
type storeFlags struct {
	url, dataDir, file string
	fs                 *flag.FlagSet
	getenv             func(string) string
}

func (f *storeFlags) register(fs *flag.FlagSet, getenv func(string) string) {
	f.fs, f.getenv = fs, getenv
	fs.StringVar(&f.url, "store", getenv("KVGATE_STORE"), "postgres://... or sqlite://PATH (env KVGATE_STORE; then the configuration file's store; default: SQLite under --data-dir)")
	fs.StringVar(&f.dataDir, "data-dir", envOr(getenv, "KVGATE_DATA_DIR", "data"), "directory of the embedded store (env KVGATE_DATA_DIR; then the configuration file's data_dir)")
	fs.StringVar(&f.file, "config", getenv("KVGATE_CONFIG"), "YAML configuration file whose store and data_dir to use (env KVGATE_CONFIG)")
}

// resolve fills in what neither flag nor environment gave from the
// configuration file.
func (f *storeFlags) resolve() error {
	if f.file == "" {
		return nil
	}
	set := map[string]bool{}
	f.fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	cfg := defaultConfig()
	if err := loadYAMLFile(f.file, cfg); err != nil {
		return err
	}
	if !set["store"] && f.getenv("KVGATE_STORE") == "" {
		f.url = cfg.Store
	}
	if !set["data-dir"] && f.getenv("KVGATE_DATA_DIR") == "" {
		f.dataDir = cfg.DataDir
	}
	return nil
}

// openStore opens the store, applying its migrations with migrate (kvgate
// migrate) or refusing one that lacks any (tenants, keys).
func (f *storeFlags) openStore(ctx context.Context, migrate bool) (*sqlstore.Store, store.Location, []int, error) {
	if err := f.resolve(); err != nil {
		return nil, store.Location{}, nil, err
	}
	return openStore(ctx, f.url, f.dataDir, migrate)
}

func (f *storeFlags) open(ctx context.Context) (*sqlstore.Store, error) {
	s, _, _, err := f.openStore(ctx, false)
	return s, err
}

// parseInterleaved parses flags given before and after positional
// arguments ("create acme --rpm 5"), and returns the positional ones.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// limitFlags are a tenant's limits as flags.
type limitFlags struct {
	weight                                                           int
	rpm, tpm, conc, pendingJobs, pendingTokens, dailyTok, monthlyTok int64
	dailySpend, monthlySpend                                         float64
}

func (l *limitFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&l.weight, "weight", 1, "share in weighted fair scheduling")
	fs.Int64Var(&l.rpm, "rpm", 0, "requests per minute (0: unlimited)")
	fs.Int64Var(&l.tpm, "tpm", 0, "tokens per minute, prompt plus output budget (0: unlimited)")
	fs.Int64Var(&l.conc, "max-concurrency", 0, "requests in flight (0: unlimited)")
	fs.Int64Var(&l.pendingJobs, "max-pending-jobs", 0, "jobs accepted and not yet final (0: unlimited)")
	fs.Int64Var(&l.pendingTokens, "max-pending-tokens", 0, "token estimates of the pending jobs (0: unlimited)")
	fs.Int64Var(&l.dailyTok, "daily-tokens", 0, "token budget per UTC day (0: unlimited)")
	fs.Int64Var(&l.monthlyTok, "monthly-tokens", 0, "token budget per UTC month (0: unlimited)")
	fs.Float64Var(&l.dailySpend, "daily-spend", 0, "spending budget per UTC day, in the configured currency (0: unlimited)")
	fs.Float64Var(&l.monthlySpend, "monthly-spend", 0, "spending budget per UTC month, in the configured currency (0: unlimited)")
}

// apply sets the limits whose flags were given.
func (l *limitFlags) apply(fs *flag.FlagSet, t *store.Tenant) error {
	var err error
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "weight":
			t.Weight = l.weight
		case "rpm":
			t.Limits.RPM = l.rpm
		case "tpm":
			t.Limits.TPM = l.tpm
		case "max-concurrency":
			t.Limits.MaxConcurrency = l.conc
		case "max-pending-jobs":
			t.Limits.MaxPendingJobs = l.pendingJobs
		case "max-pending-tokens":
			t.Limits.MaxPendingTokens = l.pendingTokens
		case "daily-tokens":
			t.Limits.DailyTokens = l.dailyTok
		case "monthly-tokens":
			t.Limits.MonthlyTokens = l.monthlyTok
		case "daily-spend":
			t.Limits.DailySpend = int64(math.Round(l.dailySpend * 1e6))
		case "monthly-spend":
			t.Limits.MonthlySpend = int64(math.Round(l.monthlySpend * 1e6))
		}
	})
	lm := t.Limits
	for _, v := range []int64{lm.RPM, lm.TPM, lm.MaxConcurrency, lm.MaxPendingJobs, lm.MaxPendingTokens, lm.DailyTokens, lm.MonthlyTokens,
		lm.DailySpend, lm.MonthlySpend} {
		if v < 0 {
			err = errors.New("limits are 0 (unlimited) or more")
		}
	}
	if t.Weight < 1 || t.Weight > store.MaxWeight {
		err = fmt.Errorf("--weight is 1 to %d", store.MaxWeight)
	}
	return err
}

// subcommand reads the subcommand of `kvgate group` and returns a flag set
// for it; without one (help, or nothing given) it prints usage and returns
// a nil flag set, with an error when nothing was given.
func subcommand(group, usage string, args []string, stderr io.Writer) (string, *flag.FlagSet, error) {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		fmt.Fprint(stderr, usage)
		if len(args) == 0 {
			return "", nil, fmt.Errorf("no %s command given", group)
		}
		return "", nil, nil
	}
	fs := flag.NewFlagSet("kvgate "+group+" "+args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage) }
	return args[0], fs, nil
}

// runTenants is `kvgate tenants`.
func runTenants(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cmd, fs, err := subcommand("tenants", tenantsUsage, args, stderr)
	if fs == nil {
		return err
	}
	var sf storeFlags
	sf.register(fs, getenv)
	var lf limitFlags
	if cmd == "create" || cmd == "update" {
		lf.register(fs)
	}
	pos, err := parseInterleaved(fs, args[1:])
	if err != nil {
		return err
	}
	want := 1
	if cmd == "list" {
		want = 0
	}
	if len(pos) != want {
		fmt.Fprint(stderr, tenantsUsage)
		return fmt.Errorf("tenants %s takes %d argument(s), got %d", cmd, want, len(pos))
	}
	switch cmd {
	case "create", "update", "delete", "list":
	default:
		fmt.Fprint(stderr, tenantsUsage)
		return fmt.Errorf("unknown tenants command %q", cmd)
	}
	st, err := sf.open(ctx)
	if err != nil {
		return err
	}
	defer st.Close()
	now := time.Now()
	switch cmd {
	case "create":
		t := store.Tenant{Name: pos[0], Weight: 1, CreatedAt: now, UpdatedAt: now}
		if err := lf.apply(fs, &t); err != nil {
			return err
		}
		if err := st.CreateTenant(ctx, t); err != nil {
			if errors.Is(err, store.ErrTenantNameRetired) {
				return fmt.Errorf("tenant %q was deleted, and its jobs, files and usage stay under the name; give the new tenant another name", t.Name)
			}
			if errors.Is(err, store.ErrExists) {
				return fmt.Errorf("tenant %q already exists (kvgate tenants update changes it)", t.Name)
			}
			return err
		}
		return printTenants(stdout, []store.Tenant{t})
	case "update":
		t, err := st.UpdateTenant(ctx, pos[0], now, func(t *store.Tenant) error { return lf.apply(fs, t) })
		if errors.Is(err, store.ErrNotFound) {
			return fmt.Errorf("no tenant %q", pos[0])
		}
		if err != nil {
			return err
		}
		return printTenants(stdout, []store.Tenant{t})
	case "delete":
		if err := st.DeleteTenant(ctx, pos[0], now); err != nil {
			if errors.Is(err, store.ErrNotFound) {
				return fmt.Errorf("no tenant %q", pos[0])
			}
			return err
		}
		fmt.Fprintf(stdout, "deleted tenant %s and revoked its keys\n", pos[0])
		return nil
	}
	ts, err := everyPage(func(after string, limit int) ([]store.Tenant, bool, error) {
		return st.ListTenants(ctx, after, limit)
	}, func(t store.Tenant) string { return t.Name })
	if err != nil {
		return err
	}
	return printTenants(stdout, ts)
}

// spend writes a spending budget (micro-units) in the currency.
func spend(v int64) string {
	if v == 0 {
		return "-"
	}
	return strconv.FormatFloat(float64(v)/1e6, 'f', -1, 64)
}

func limit(v int64) string {
	if v == 0 {
		return "-"
	}
	return strconv.FormatInt(v, 10)
}

func printTenants(w io.Writer, ts []store.Tenant) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tWEIGHT\tRPM\tTPM\tCONCURRENCY\tPENDING JOBS\tPENDING TOKENS\tDAILY TOKENS\tMONTHLY TOKENS\tDAILY SPEND\tMONTHLY SPEND")
	for _, t := range ts {
		l := t.Limits
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.Name, t.Weight, limit(l.RPM), limit(l.TPM), limit(l.MaxConcurrency),
			limit(l.MaxPendingJobs), limit(l.MaxPendingTokens), limit(l.DailyTokens), limit(l.MonthlyTokens), spend(l.DailySpend), spend(l.MonthlySpend))
	}
	return tw.Flush()
}

// runKeys is `kvgate keys`.
func runKeys(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cmd, fs, err := subcommand("keys", keysUsage, args, stderr)
	if fs == nil {
		return err
	}
	var sf storeFlags
	sf.register(fs, getenv)
	var tenant, role, name string
	var rpm, tpm, conc int64
	switch cmd {
	case "create":
		fs.StringVar(&role, "role", "user", "user, operator (also sees retry details and usage) or admin (manages tenants and keys)")
		fs.StringVar(&name, "name", "", "a label for listings")
		fs.Int64Var(&rpm, "rpm", 0, "the key's own requests per minute (0: the tenant's only)")
		fs.Int64Var(&tpm, "tpm", 0, "the key's own tokens per minute (0: the tenant's only)")
		fs.Int64Var(&conc, "max-concurrency", 0, "the key's own requests in flight (0: the tenant's only)")
		fallthrough
	case "list":
		fs.StringVar(&tenant, "tenant", "", "the key's tenant")
	case "revoke", "rotate":
	default:
		fmt.Fprint(stderr, keysUsage)
		return fmt.Errorf("unknown keys command %q", cmd)
	}
	pos, err := parseInterleaved(fs, args[1:])
	if err != nil {
		return err
	}
	want := 0
	if cmd == "revoke" || cmd == "rotate" {
		want = 1
	}
	if len(pos) != want {
		fmt.Fprint(stderr, keysUsage)
		return fmt.Errorf("keys %s takes %d argument(s), got %d", cmd, want, len(pos))
	}
	if cmd == "create" {
		if tenant == "" {
			return errors.New("keys create needs --tenant")
		}
		if !store.Role(role).Valid() {
			return fmt.Errorf("--role %q is not user, operator or admin", role)
		}
		if rpm < 0 || tpm < 0 || conc < 0 {
			return errors.New("limits are 0 (unlimited) or more")
		}
	}
	st, err := sf.open(ctx)
	if err != nil {
		return err
	}
	defer st.Close()
	now := time.Now()
	switch cmd {
	case "create":
		secret, k := gateway.NewAPIKey(tenant, store.Role(role), name, now)
		k.Limits = store.Limits{RPM: rpm, TPM: tpm, MaxConcurrency: conc}
		return createKey(ctx, st, k, secret, stdout, stderr)
	case "revoke", "rotate":
		k, err := findKey(ctx, st, pos[0])
		if err != nil {
			return err
		}
		if cmd == "rotate" {
			// The revocation and the new key in one transaction, as the
			// admin API rotates.
			secret, nk := gateway.NewAPIKey(k.Tenant, k.Role, k.Name, now)
			nk.Limits = k.Limits
			if err := st.RotateKey(ctx, k.ID, nk, now); err != nil {
				if errors.Is(err, store.ErrNotFound) {
					return fmt.Errorf("key %s was revoked or rotated meanwhile, or its tenant %s is gone: no key made", k.ID, k.Tenant)
				}
				return err
			}
			fmt.Fprintln(stdout, secret)
			fmt.Fprintf(stderr, "created %s key %s for tenant %s: store it now, it is not shown again\n", nk.Role, nk.ID, nk.Tenant)
		} else if err := st.RevokeKey(ctx, k.ID, now); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "revoked %s (%s..., tenant %s); replicas stop accepting it within their key cache TTL\n", k.ID, k.Prefix, k.Tenant)
		return nil
	}
	ks, err := everyPage(func(after string, limit int) ([]store.APIKey, bool, error) {
		return st.ListKeys(ctx, tenant, after, limit)
	}, func(k store.APIKey) string { return k.ID })
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tPREFIX\tTENANT\tROLE\tNAME\tCREATED\tREVOKED")
	for _, k := range ks {
		revoked := "-"
		if !k.RevokedAt.IsZero() {
			revoked = k.RevokedAt.Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s...\t%s\t%s\t%s\t%s\t%s\n", k.ID, k.Prefix, k.Tenant, k.Role, k.Name, k.CreatedAt.Format(time.RFC3339), revoked)
	}
	return tw.Flush()
}

// createKey stores a key and prints it, alone, on stdout.
func createKey(ctx context.Context, st *sqlstore.Store, k store.APIKey, secret string, stdout, stderr io.Writer) error {
	if err := st.CreateKey(ctx, k); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return fmt.Errorf("no tenant %q (kvgate tenants create %s)", k.Tenant, k.Tenant)
		}
		return err
	}
	fmt.Fprintln(stdout, secret)
	fmt.Fprintf(stderr, "created %s key %s for tenant %s: store it now, it is not shown again\n", k.Role, k.ID, k.Tenant)
	return nil
}

func findKey(ctx context.Context, st *sqlstore.Store, id string) (store.APIKey, error) {
	k, err := st.GetKey(ctx, id)
	if errors.Is(err, store.ErrNotFound) || err == nil && !k.RevokedAt.IsZero() {
		return store.APIKey{}, fmt.Errorf("no valid key %q (kvgate keys list)", id)
	}
	return k, err
}

// everyPage reads a paged list whole, a thousand at a time; id names an
// item as the next page's cursor.
func everyPage[T any](page func(after string, limit int) ([]T, bool, error), id func(T) string) ([]T, error) {
	var all []T
	after := ""
	for {
		items, more, err := page(after, 1000)
		if err != nil {
			return nil, err
		}
		all = append(all, items...)
		if !more || len(items) == 0 {
			return all, nil
		}
		after = id(items[len(items)-1])
	}
}
