package sqlstore

import "testing"

// TestCursorMovesOnlyFromWhatItRead: a claim moves the turn's cursor only
// from the position it read; one that finishes after another claim moved
// it leaves it, so a slow claim never turns the cursor back.
func TestCursorMovesOnlyFromWhatItRead(t *testing.T) {
	var s Store
	cur, move := s.cursor()
	if cur != "" {
		t.Fatalf("a new store's cursor is %q, want ''", cur)
	}
	slow, moveSlow := s.cursor()
	move("b")
	if cur, _ := s.cursor(); cur != "b" {
		t.Fatalf("after a move to b: %q", cur)
	}
	moveSlow("a") // read '' before the move to b
	if cur, _ := s.cursor(); cur != "b" || slow != "" {
		t.Errorf("a claim that read %q moved the cursor from b to %q", slow, cur)
	}
	_, move = s.cursor()
	move("c")
	if cur, _ := s.cursor(); cur != "c" {
		t.Errorf("after a move to c: %q", cur)
	}
}
