package store

import (
	"strings"
	"testing"
)

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

// TestRedact: a store URL printed (the log at start, a refusal) shows no
// password, in its user part or in its query, and a string that is no
// URL, or a mistyped one, shows none of what follows its scheme.
func TestRedact(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://u:secret@h/db":                                "postgres://u:xxxxx@h/db",
		"postgres://u@h/db?password=secret&sslmode=require":       "postgres://u@h/db?password=xxxxx&sslmode=require",
		"postgres://u@h/db?sslpassword=secret":                    "postgres://u@h/db?sslpassword=xxxxx",
		"postgres://u@h/db":                                       "postgres://u@h/db",
		"host=h user=u password=secret":                           "...",
		"postgress://u:secret@h/db":                               "postgress://u:xxxxx@h/db",
		"postgres://u:secret@h:port/db":                           "postgres://...",
		"mysql://u:secret@h/db":                                   "mysql://u:xxxxx@h/db",
		"postgres://u@h/db?application_name=kvgate&PASSWORD=s3cr": "postgres://u@h/db?PASSWORD=xxxxx&application_name=kvgate",
	} {
		if got := Redact(in); got != want {
			t.Errorf("Redact(%q) = %q, want %q", in, got, want)
		}
	}
	if _, err := ParseLocation("postgress://u:secret@h/db", ""); err == nil || strings.Contains(err.Error(), "secret") {
		t.Errorf("a mistyped store URL's error: %v", err)
	}
}
