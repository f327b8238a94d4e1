package store

import "testing"

func TestParseLocation(t *testing.T) {
	for _, tc := range []struct {
		url, dir string
		want     Location
		err      bool
	}{
		{"", "/var/lib/kvgate", Location{"sqlite", "/var/lib/kvgate/kvgate.db"}, false},
		{"sqlite:///tmp/x.db", "", Location{"sqlite", "/tmp/x.db"}, false},
		{"sqlite://rel.db", "", Location{"sqlite", "rel.db"}, false},
		{"postgres://u@h/db", "", Location{"postgres", "postgres://u@h/db"}, false},
		{"postgresql://u@h/db", "", Location{"postgres", "postgresql://u@h/db"}, false},
		{"sqlite://", "", Location{}, true},
		{"mysql://x", "", Location{}, true},
	} {
		got, err := ParseLocation(tc.url, tc.dir)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("ParseLocation(%q, %q) = %+v, %v", tc.url, tc.dir, got, err)
		}
	}
}
