package store

import (
	"fmt"
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
	return Location{}, fmt.Errorf("store %q: want postgres://... or sqlite://PATH", url)
}
