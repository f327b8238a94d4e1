package chaos

import (
	"cmp"
	"slices"
	"testing"
	"time"
)

// TestViolations checks the invariants themselves on made-up snapshots:
// each broken one is found and named with its job, and a clean history
// breaks none. It runs in every mode: it starts no process.
func TestViolations(t *testing.T) {
	now := time.Now()
	later := now.Add(time.Hour)
	job := func(id, state string, attempt int) jobRec {
		return jobRec{id: id, key: "k-" + id, state: state, attempt: attempt, maxAttempts: 5, deadline: later, updated: now,
			hasResult: state == "SUCCEEDED"}
	}
	ok := attemptRec{attempt: 1, fence: 1, outcome: "succeeded", spent: true, sent: true}
	done := eventRec{typ: "job.succeeded", state: "SUCCEEDED", published: true}
	base := func() snapshot {
		return snapshot{
			at:           now,
			jobs:         []jobRec{job("a", "SUCCEEDED", 1)},
			attempts:     map[string][]attemptRec{"a": {ok}},
			events:       map[string][]eventRec{"a": {done}},
			accepted:     map[string]string{"k-a": "a"},
			calls:        1,
			served:       1,
			spentColumns: true,
		}
	}
	tests := []struct {
		name   string
		change func(s *snapshot)
		want   []violation // invariant and job only
	}{
		{"clean", func(*snapshot) {}, nil},
		{"a wait and an interruption that spent nothing", func(s *snapshot) {
			s.attempts["a"] = []attemptRec{
				{attempt: 1, fence: 1, outcome: "wait", class: "no_capacity"},
				{attempt: 1, fence: 2, outcome: "interrupted", class: "interrupted", sent: true},
				{attempt: 1, fence: 3, outcome: "succeeded", spent: true, sent: true},
			}
			s.calls = 2 // the interrupted one may have reached a backend
		}, nil},
		{"a retried backend failure, then terminal", func(s *snapshot) {
			j := job("b", "FAILED_TERMINAL", 2)
			j.maxAttempts = 2
			s.jobs = append(s.jobs, j)
			s.accepted["k-b"] = "b"
			s.attempts["b"] = []attemptRec{
				{attempt: 1, fence: 1, outcome: "failed", class: "backend_error", spent: true, sent: true},
				{attempt: 2, fence: 2, outcome: "failed", class: "timeout", spent: true, sent: true},
			}
			s.calls = 3
		}, nil},
		{"a retry reused the inference a lost lease paid for", func(s *snapshot) {
			s.attempts["a"] = []attemptRec{
				{attempt: 1, fence: 1, outcome: "lease_expired", class: "lease_expired", spent: true, sent: true},
				{attempt: 2, fence: 2, outcome: "succeeded"},
			}
		}, nil},
		{"a success that nothing paid for", func(s *snapshot) {
			s.jobs[0].attempt = 0
			s.attempts["a"] = []attemptRec{{attempt: 1, fence: 1, outcome: "succeeded", sent: true}}
		}, []violation{{invariant: invExplained, job: "a"}}},
		{"deadline passed before it ran", func(s *snapshot) {
			j := job("b", "FAILED_TERMINAL", 0)
			j.errorClass, j.deadline = "deadline_exceeded", now.Add(-time.Minute)
			s.jobs = append(s.jobs, j)
			s.accepted["k-b"] = "b"
		}, nil},
		{"accepted, not stored", func(s *snapshot) { s.accepted["k-x"] = "x" }, []violation{{invariant: invAccounted, job: "x"}}},
		{"stored, never given", func(s *snapshot) {
			s.jobs = append(s.jobs, job("b", "READY", 0))
		}, []violation{{invariant: invAccounted, job: "b"}}},
		{"runnable past its deadline", func(s *snapshot) {
			j := job("b", "RETRY_SCHEDULED", 0)
			j.deadline = now.Add(-time.Second)
			s.jobs = append(s.jobs, j)
			s.accepted["k-b"] = "b"
		}, []violation{{invariant: invAccounted, job: "b"}}},
		{"dead-lettered by the shutdown (max_attempts 1)", func(s *snapshot) {
			j := job("b", "FAILED_TERMINAL", 1)
			j.maxAttempts = 1
			s.jobs = append(s.jobs, j)
			s.accepted["k-b"] = "b"
			s.attempts["b"] = []attemptRec{{attempt: 1, fence: 1, outcome: "interrupted", class: "backend_error", spent: true, sent: true}}
		}, []violation{{invariant: invExplained, job: "b"}, {invariant: invTerminal, job: "b"}}},
		{"cold start: attempts spent waiting for a backend", func(s *snapshot) {
			j := job("b", "FAILED_TERMINAL", 2)
			j.maxAttempts = 2
			s.jobs = append(s.jobs, j)
			s.accepted["k-b"] = "b"
			s.attempts["b"] = []attemptRec{
				{attempt: 1, fence: 1, outcome: "retry", class: "no_capacity", spent: true},
				{attempt: 2, fence: 2, outcome: "retry", class: "no_capacity", spent: true},
			}
		}, []violation{{invariant: invExplained, job: "b"}, {invariant: invExplained, job: "b"}, {invariant: invTerminal, job: "b"}}},
		{"a spent attempt that sent nothing", func(s *snapshot) {
			s.jobs[0].attempt = 2
			s.attempts["a"] = append([]attemptRec{{attempt: 1, fence: 1, outcome: "failed", class: "backend_error", spent: true}}, ok)
		}, []violation{{invariant: invExplained, job: "a"}}},
		{"counter ahead of the records", func(s *snapshot) { s.jobs[0].attempt = 3 }, []violation{{invariant: invExplained, job: "a"}}},
		{"a record without outcome or class", func(s *snapshot) {
			s.attempts["a"] = append([]attemptRec{{attempt: 1, fence: 1}}, ok)
		}, []violation{{invariant: invExplained, job: "a"}, {invariant: invExplained, job: "a"}}},
		{"completed twice", func(s *snapshot) {
			s.jobs[0].attempt = 2
			s.attempts["a"] = append(s.attempts["a"], attemptRec{attempt: 2, fence: 2, outcome: "succeeded", spent: true, sent: true})
			s.calls = 2
		}, []violation{{invariant: invOnce, job: "a"}}},
		{"two SUCCEEDED events", func(s *snapshot) { s.events["a"] = append(s.events["a"], done) }, []violation{{invariant: invOnce, job: "a"}}},
		{"SUCCEEDED without a result", func(s *snapshot) { s.jobs[0].hasResult = false }, []violation{{invariant: invOnce, job: "a"}}},
		{"a success lost", func(s *snapshot) {
			s.jobs[0].state = "RETRY_SCHEDULED"
		}, []violation{{invariant: invOnce, job: "a"}}},
		{"a backend call with no record", func(s *snapshot) { s.calls = 2 }, []violation{{invariant: invBudget}}},
		{"a running job may have a call in flight", func(s *snapshot) {
			s.jobs = append(s.jobs, job("b", "RUNNING", 0))
			s.accepted["k-b"] = "b"
			s.calls = 2
		}, nil},
		{"a result no engine produced", func(s *snapshot) { s.served = 0 }, []violation{{invariant: invServed}}},
		{"old schema: the claim counted a running attempt", func(s *snapshot) {
			s.spentColumns = false
			s.jobs = append(s.jobs, job("b", "RUNNING", 1))
			s.accepted["k-b"] = "b"
		}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := base()
			tc.change(&s)
			got := violations(s)
			var short []violation
			for _, v := range got {
				short = append(short, violation{invariant: v.invariant, job: v.job})
			}
			slices.SortFunc(short, func(a, b violation) int {
				if a.invariant != b.invariant {
					return cmp.Compare(a.invariant, b.invariant)
				}
				return cmp.Compare(a.job, b.job)
			})
			want := slices.Clone(tc.want)
			slices.SortFunc(want, func(a, b violation) int {
				if a.invariant != b.invariant {
					return cmp.Compare(a.invariant, b.invariant)
				}
				return cmp.Compare(a.job, b.job)
			})
			if !slices.Equal(short, want) {
				t.Errorf("violations %v, want %v; in full:", short, want)
				for _, v := range got {
					t.Logf("  %s %s: %s", v.invariant, v.job, v.detail)
				}
			}
		})
	}
}
