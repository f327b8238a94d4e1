package chaos

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
)

// pgCluster is the suite's private PostgreSQL: its own data directory and
// port, so that restarting it disturbs nothing else on the machine. Each
// scenario gets a database of its own on it.
type pgCluster struct {
	bin    string   // directory of initdb, pg_ctl
	dir    string   // the temporary directory: data/, the socket, the log
	port   int      // on 127.0.0.1
	asUser []string // the prefix that runs a command as the postgres user, for root
}

// findPGBin finds PostgreSQL's server programs: KVGATE_CHAOS_PG_BIN, the
// newest /usr/lib/postgresql/*/bin, or initdb on PATH.
func findPGBin() (string, error) {
	if d := os.Getenv("KVGATE_CHAOS_PG_BIN"); d != "" {
		if _, err := exec.LookPath(filepath.Join(d, "pg_ctl")); err != nil {
			return "", fmt.Errorf("KVGATE_CHAOS_PG_BIN: %w", err)
		}
		return d, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
		return vb - va
	})
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "pg_ctl")); err == nil {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	return "", errors.New("no PostgreSQL server programs (initdb, pg_ctl) under /usr/lib/postgresql/*/bin or on PATH; set KVGATE_CHAOS_PG_BIN")
}

// startCluster initialises and starts a private cluster with trust
// authentication on a free port. As root, the server runs as the postgres
// user (PostgreSQL refuses to run as root).
func startCluster() (*pgCluster, error) {
	bin, err := findPGBin()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "kvgate-chaos-pg-")
	if err != nil {
		return nil, err
	}
	c := &pgCluster{bin: bin, dir: dir}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("running as root, the cluster needs a postgres user: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		runuser, err := exec.LookPath("runuser")
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("running as root, the cluster needs runuser: %w", err)
		}
		c.asUser = []string{runuser, "-u", "postgres", "--"}
	}
	if out, err := c.run("initdb", "-D", c.data(), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %v\n%s", err, out)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	c.port = ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	if err := c.pgctl("start"); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return c, nil
}

func (c *pgCluster) data() string { return filepath.Join(c.dir, "data") }

// run runs one of the cluster's programs as the cluster's user.
func (c *pgCluster) run(prog string, args ...string) ([]byte, error) {
	argv := append(slices.Clone(c.asUser), filepath.Join(c.bin, prog))
	cmd := exec.Command(argv[0], append(argv[1:], args...)...)
	cmd.Dir = c.dir
	return cmd.CombinedOutput()
}

// pgctl runs pg_ctl start, restart or stop and waits for it to finish.
// fsync is off: the suite restarts the server, never the machine.
func (c *pgCluster) pgctl(action string, extra ...string) error {
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300", c.port, c.dir)
	args := append([]string{action, "-D", c.data(), "-w", "-t", "60", "-l", filepath.Join(c.dir, "server.log"), "-o", opts}, extra...)
	if out, err := c.run("pg_ctl", args...); err != nil {
		return fmt.Errorf("pg_ctl %s: %v\n%s\n%s", action, err, out, tailFile(filepath.Join(c.dir, "server.log"), 20))
	}
	return nil
}

// restart is the fault: pg_ctl restart in fast mode (open sessions are
// cut, the server shuts down cleanly and starts again).
func (c *pgCluster) restart() error { return c.pgctl("restart", "-m", "fast") }

// stop stops the server and removes its files.
func (c *pgCluster) stop() {
	_ = c.pgctl("stop", "-m", "immediate")
	os.RemoveAll(c.dir)
}

// url is the URL of a database on the cluster.
func (c *pgCluster) url(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.port, db)
}

// createDB creates an empty database and returns its URL.
func (c *pgCluster) createDB(ctx context.Context, name string) (string, error) {
	db, err := sql.Open("pgx", c.url("postgres"))
	if err != nil {
		return "", err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return c.url(name), nil
}

// dbName turns a test name into a database name.
func dbName(test string) string {
	var b strings.Builder
	b.WriteString("chaos_")
	for _, r := range strings.ToLower(test) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	return fmt.Sprintf("%.50s_%d", b.String(), time.Now().UnixNano()%1e6)
}
