package sqlstore_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// TestBatchLinesPageByBytes: a page of a batch's lines ends once their
// results hold the page's bytes, so that a finalization's memory does not
// grow with the results' size (embeddings of many inputs run to
// megabytes a line); the pages still hold every line once.
func TestBatchLinesPageByBytes(t *testing.T) {
	ctx := context.Background()
	s, err := sqlite.Open(ctx, filepath.Join(t.TempDir(), "kv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := sqlite.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	result := `{"data":"` + strings.Repeat("x", 1000) + `"}` // about 1 KiB
	for i := range 5 {
		j, _, err := s.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
			Tenant: "acme", IdempotencyKey: fmt.Sprint("line-", i), RequestHash: "h", Endpoint: "/v1/embeddings", Model: "m",
			Body: json.RawMessage(`{}`), MaxAttempts: 3, Deadline: now.Add(time.Hour), Now: now})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.DB().ExecContext(ctx, `UPDATE jobs SET batch_id = 'b1', state = 'SUCCEEDED', result = ? WHERE id = ?`, []byte(result), j.ID); err != nil {
			t.Fatal(err)
		}
	}
	sqlstore.SetBatchLinesBytes(s, 2500)
	var pages []int
	seen := map[string]bool{}
	for after := ""; ; {
		lines, err := s.BatchLines(ctx, "b1", after, 500)
		if err != nil {
			t.Fatal(err)
		}
		if len(lines) == 0 {
			break
		}
		pages = append(pages, len(lines))
		for _, l := range lines {
			if seen[l.JobID] || string(l.Result) != result {
				t.Errorf("line %s twice, or its result lost", l.JobID)
			}
			seen[l.JobID] = true
		}
		after = lines[len(lines)-1].JobID
	}
	if len(seen) != 5 || len(pages) != 2 || pages[0] != 3 {
		t.Errorf("5 lines of 1 KiB, pages of 2,500 bytes: pages %v, %d lines; want [3 2], 5", pages, len(seen))
	}
}
