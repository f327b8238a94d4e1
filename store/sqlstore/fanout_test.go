package sqlstore

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestEventsFanOut: every statement of the store that inserts into the
// outbox is written through eventsCTE or eventsStatement (fanout.go),
// the one place that makes webhook deliveries on PostgreSQL, where no
// trigger does any more for kvgate's own writes (migration 25).
func TestEventsFanOut(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	inserts := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") || f == "fanout.go" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			if !strings.Contains(strings.ToUpper(line), "INSERT INTO OUTBOX") || strings.HasPrefix(strings.TrimSpace(line), "//") {
				continue
			}
			inserts++
			if !strings.Contains(line, "eventsCTE(") && !strings.Contains(line, "eventsStatement(") {
				t.Errorf("%s:%d inserts events without fanning them out (fanout.go): %s", f, i+1, strings.TrimSpace(line))
			}
		}
	}
	if inserts == 0 {
		t.Error("found no insert into the outbox: the check reads nothing")
	}
}

// TestEventsCTE: events that no endpoint can subscribe to are written
// alone; the others, or a type known only per row, with their fan-out.
func TestEventsCTE(t *testing.T) {
	const ins = "INSERT INTO outbox (id) VALUES (1)"
	for typ, fans := range map[string]bool{"job.running": false, "job.accepted": false, "": true, "job.succeeded": true,
		"job.dead_lettered": true, "batch.completed": true, "batch.in_progress": false} {
		got := eventsCTE(typ, ins)
		if strings.Contains(got, "webhook_deliveries") != fans {
			t.Errorf("eventsCTE(%q) fans out %v: %s", typ, !fans, got)
		}
		if strings.Contains(eventsStatement(Dialect{WritableCTE: true}, typ, ins), "webhook_deliveries") != fans {
			t.Errorf("eventsStatement(%q) fans out %v", typ, !fans)
		}
		if eventsStatement(Dialect{}, typ, ins) != ins {
			t.Errorf("eventsStatement(%q) without writable CTEs changed the insert (the trigger fans out there)", typ)
		}
	}
}
