package bench

import (
	"strings"
	"time"
)

// Workloads whose prompts share prefixes as real chat traffic does: a
// tenant's system prompt before every question (system-prompt), and
// conversations that resend their history on every turn (multi-turn).

// session is one multi-turn conversation: its system prompt and the turns
// so far, as the client would resend them.
type session struct {
	group    int
	messages []chatMsg
	tokens   int // of the history
	turns    int
}

// systemPrompt draws a request of a random group's system prompt and a
// fresh question of in tokens.
func (s *source) systemPrompt(in, out int) item {
	g := s.rng.IntN(len(s.prefixes))
	q := wordText(s.rng, in)
	msgs := []chatMsg{{Role: "system", Content: s.prefixes[g]}, {Role: "user", Content: q}}
	return item{prompt: s.prefixes[g] + q, messages: msgs, inputLen: s.w.PrefixLen + in, outputLen: out}
}

// turn draws the next turn of a random session: its history, then a new
// question of in tokens. The session then records the question and an
// answer of out tokens, which its next turn resends (the simulator's
// answers are filler, so the client's record of them is filler too: the
// history is a prefix of every later turn, as a real client's is). A
// session that has had Turns turns starts over as a new conversation with
// a new system prompt.
func (s *source) turn(in, out int) item {
	if s.sessions == nil {
		s.sessions = make([]session, len(s.prefixes))
		for i := range s.sessions {
			s.sessions[i] = s.newSession(i, false)
		}
	}
	i := s.rng.IntN(len(s.sessions))
	ss := &s.sessions[i]
	if ss.turns >= s.w.Turns {
		*ss = s.newSession(i, true)
	}
	q := wordText(s.rng, in)
	msgs := append(append(make([]chatMsg, 0, len(ss.messages)+1), ss.messages...), chatMsg{Role: "user", Content: q})
	var flat strings.Builder
	for _, m := range msgs {
		flat.WriteString(m.Content)
	}
	it := item{prompt: flat.String(), messages: msgs, inputLen: ss.tokens + in, outputLen: out}
	ss.messages = append(msgs, chatMsg{Role: "assistant", Content: wordText(s.rng, out)})
	ss.tokens += in + out
	ss.turns++
	return it
}

// newSession starts session i: the group's own system prompt, or, for a
// session starting over, a new one drawn from the source.
func (s *source) newSession(i int, again bool) session {
	sys := s.prefixes[i]
	if again {
		sys = wordText(s.rng, s.w.PrefixLen)
	}
	return session{group: i, messages: []chatMsg{{Role: "system", Content: sys}}, tokens: s.w.PrefixLen}
}

// stepped returns n send offsets whose rate rises in g.steps equal steps,
// from rate/steps to rate: step j of k runs at rate·j/k for an equal share
// of the time, so that the mean is rate·(k+1)/(2k) and the last step
// offers the full rate.
func (g *gaps) stepped(n int) []time.Duration {
	k := g.steps
	mean := g.rate * float64(k+1) / float64(2*k)
	seg := float64(n) / mean / float64(k) // seconds per step
	out := make([]time.Duration, 0, n)
	t := 0.0
	for len(out) < n {
		j := min(int(t/seg), k-1)
		r := g.rate * float64(j+1) / float64(k)
		step := gaps{kind: g.kind, rate: r, burstiness: g.burstiness, rng: g.rng}
		t += step.next()
		out = append(out, time.Duration(t*float64(time.Second)))
	}
	return out
}
