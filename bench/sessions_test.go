package bench

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

func TestSteppedArrivalsRise(t *testing.T) {
	g := newGaps(Arrival{Kind: ArrivalPoisson, Rate: 40, Burstiness: 1, Steps: 4}, rand.New(rand.NewPCG(1, 2)))
	const n = 4000
	at := g.schedule(n)
	if len(at) != n {
		t.Fatalf("%d offsets, want %d", len(at), n)
	}
	// Mean rate 40·5/8 = 25: the run lasts about 160 s, 40 s a step, at
	// 10, 20, 30 and 40 req/s.
	seg := time.Duration(float64(n) / 25 / 4 * float64(time.Second))
	counts := make([]int, 5)
	for i, d := range at {
		if i > 0 && d < at[i-1] {
			t.Fatal("offsets go backwards")
		}
		counts[min(int(d/seg), 4)]++
	}
	for j := range 4 {
		want := 10 * float64(j+1) * seg.Seconds()
		if got := float64(counts[j]); got < 0.85*want || got > 1.15*want {
			t.Errorf("step %d: %v requests, want about %.0f", j+1, got, want)
		}
	}
}

func TestSystemPromptWorkload(t *testing.T) {
	w, err := Workload{Kind: DatasetSystemPrompt, PrefixLen: 300, PrefixGroups: 3, Input: Dist{Mean: 50}, Output: Dist{Mean: 10}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	src, err := newSource(w, rand.New(rand.NewPCG(3, 4)))
	if err != nil {
		t.Fatal(err)
	}
	systems := map[string]int{}
	for range 60 {
		it := src.draw()
		if len(it.messages) != 2 || it.messages[0].Role != "system" || it.messages[1].Role != "user" {
			t.Fatalf("messages %+v", it.messages)
		}
		if n := len(strings.Fields(it.messages[0].Content)); n != 300 {
			t.Errorf("system prompt of %d words, want 300", n)
		}
		systems[it.messages[0].Content]++
		if it.inputLen != 350 {
			t.Errorf("input %d tokens, want 350", it.inputLen)
		}
	}
	if len(systems) != 3 {
		t.Errorf("%d distinct system prompts, want 3 (one per group)", len(systems))
	}
}

func TestMultiTurnWorkload(t *testing.T) {
	w, err := Workload{Kind: DatasetMultiTurn, PrefixLen: 100, PrefixGroups: 2, Turns: 3, Input: Dist{Mean: 20}, Output: Dist{Mean: 30}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	src, err := newSource(w, rand.New(rand.NewPCG(5, 6)))
	if err != nil {
		t.Fatal(err)
	}
	last := map[string][]chatMsg{} // by system prompt: the session's previous turn
	for range 40 {
		it := src.draw()
		sys := it.messages[0].Content
		prev, seen := last[sys]
		switch {
		case !seen:
			if len(it.messages) != 2 {
				t.Errorf("a new conversation's first turn has %d messages", len(it.messages))
			}
		default:
			// The previous turn, its answer, and one new question.
			if len(it.messages) != len(prev)+2 {
				t.Fatalf("turn of %d messages after one of %d", len(it.messages), len(prev))
			}
			for i := range prev {
				if it.messages[i] != prev[i] {
					t.Fatalf("message %d of the history changed", i)
				}
			}
			if it.messages[len(prev)].Role != "assistant" {
				t.Errorf("the history does not carry the answer")
			}
		}
		if want := 100 + 50*(len(it.messages)-2)/2 + 20; it.inputLen != want {
			t.Errorf("input %d tokens, want %d", it.inputLen, want)
		}
		if len(it.messages) > 2*3 {
			t.Errorf("a session ran past its 3 turns")
		}
		last[sys] = it.messages
	}
	if len(last) <= 2 {
		t.Errorf("sessions never started over after their turns (%d conversations)", len(last))
	}
}
