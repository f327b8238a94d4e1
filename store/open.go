package store

import (
	"fmt"
	neturl "net/url"
	"path/filepath"
	"strings"
)

// Location is where a store lives, parsed from a --store URL.
type Location struct {
	Kind string // "postgres" or "sqlite"
	URL  string // the postgres:// URL, or the SQLite file path
}

// ParseLocation reads a store URL: postgres://... (or postgresql://...),
// or sqlite://PATH. Empty means SQLite at kvgate.db under dataDir.
func ParseLocation(url, dataDir string) (Location, error) {
	switch {
	case url == "":
		return Location{Kind: "sqlite", URL: filepath.Join(dataDir, "kvgate.db")}, nil
	case strings.HasPrefix(url, "postgres://"), strings.HasPrefix(url, "postgresql://"):
		return Location{Kind: "postgres", URL: url}, nil
	case strings.HasPrefix(url, "sqlite://"):
		path := strings.TrimPrefix(url, "sqlite://")
		if path == "" {
			return Location{}, fmt.Errorf("store %q: no file path after sqlite://", url)
		}
		return Location{Kind: "sqlite", URL: path}, nil
	}
	return Location{}, fmt.Errorf("store %q: want postgres://... or sqlite://PATH", Redact(url))
}

// Redact hides the secrets of a store URL for printing: the password of
// its user, and query parameters that carry one (password, sslpassword),
// as libpq reads them. A text that is no URL is hidden whole but for its
// scheme: it may be a key=value connection string with a password in it.
func Redact(raw string) string {
	u, err := neturl.Parse(raw)
	if err != nil || u.Scheme == "" || u.Opaque != "" {
		if i := strings.Index(raw, "://"); i > 0 && !strings.ContainsAny(raw[:i], " =") {
			return raw[:i] + "://..."
		}
		return "..."
	}
	q := u.Query()
	for k := range q {
		if strings.Contains(strings.ToLower(k), "password") {
			q.Set(k, "xxxxx")
		}
	}
	u.RawQuery = q.Encode()
	return u.Redacted()
}
