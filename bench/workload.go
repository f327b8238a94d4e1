package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"time"
)

// words are short common English words. Each is one token with its leading
// space in Llama-3's tokenizer and in the simulator's, so a synthetic prompt
// of n words is about n tokens long on a real server and exactly n on the
// simulator.
var words = strings.Fields(`the and for you are was not can one all new may use two how our out any day get
has him his its now old see way who did man set put end why let big ask own run few far top law war art car
job key low air sea sun red dog cat box hot cut pay add age act bad bed bit buy cup due eat egg eye fit fly
fun gas god gun hat ice kid leg lie lot map mix net oil pen pop raw row sit six sky son ten tie toy van win`)

// TraceBlockTokens is how many tokens one hash id of a trace covers, as in
// Mooncake's published traces: prompts that share a hash id share that
// block of text, so a replay keeps the trace's prefix sharing.
const TraceBlockTokens = 512

// item is one request to send, before it becomes a body.
type item struct {
	prompt    string
	inputLen  int           // intended prompt tokens (the server's usage is what counts)
	outputLen int           // max_tokens
	at        time.Duration // a trace's send offset
	// messages, when set, is the chat to send instead of one user
	// message of prompt (sessions.go).
	messages []chatMsg
}

// source draws a workload's requests.
type source struct {
	w        Workload
	rng      *rand.Rand
	pool     []item // sharegpt and trace items, in order of use
	next     int
	prefixes []string
	sessions []session // multi-turn
}

func newSource(w Workload, rng *rand.Rand) (*source, error) {
	s := &source{w: w, rng: rng}
	switch w.Kind {
	case DatasetShareGPT:
		items, err := loadShareGPT(w.Path)
		if err != nil {
			return nil, err
		}
		rng.Shuffle(len(items), func(i, j int) { items[i], items[j] = items[j], items[i] })
		s.pool = items
	case DatasetTrace:
		items, err := loadTrace(w.Path, rng.Uint64())
		if err != nil {
			return nil, err
		}
		s.pool = items
	case DatasetPrefix, DatasetSystemPrompt, DatasetMultiTurn:
		for g := range w.PrefixGroups {
			grng := rand.New(rand.NewPCG(rng.Uint64(), uint64(g)))
			s.prefixes = append(s.prefixes, wordText(grng, w.PrefixLen))
		}
	}
	if w.FixedOutput > 0 {
		for i := range s.pool {
			s.pool[i].outputLen = w.FixedOutput
		}
	}
	return s, nil
}

// len returns how many distinct requests a file-backed workload holds, or
// -1 for a synthetic one.
func (s *source) len() int {
	if s.pool == nil {
		return -1
	}
	return len(s.pool)
}

// draw returns the next request. File-backed workloads cycle through their
// items.
func (s *source) draw() item {
	if s.pool != nil {
		it := s.pool[s.next%len(s.pool)]
		s.next++
		return it
	}
	in, out := s.w.Input.draw(s.rng), s.w.Output.draw(s.rng)
	switch s.w.Kind {
	case DatasetSystemPrompt:
		return s.systemPrompt(in, out)
	case DatasetMultiTurn:
		return s.turn(in, out)
	}
	if s.w.Kind == DatasetPrefix {
		p := s.prefixes[s.rng.IntN(len(s.prefixes))]
		return item{prompt: p + wordText(s.rng, in), inputLen: s.w.PrefixLen + in, outputLen: out}
	}
	return item{prompt: wordText(s.rng, in), inputLen: in, outputLen: out}
}

// draw returns a length from d, at least 1 and within its bounds.
func (d Dist) draw(rng *rand.Rand) int {
	var x float64
	switch d.Kind {
	case DistUniform:
		return d.Min + rng.IntN(d.Max-d.Min+1)
	case DistNormal:
		x = d.Mean + d.StdDev*rng.NormFloat64()
	case DistLogNormal:
		// The log-normal whose mean and standard deviation are Mean and StdDev.
		s2 := math.Log(1 + d.StdDev*d.StdDev/(d.Mean*d.Mean))
		x = math.Exp(math.Log(d.Mean) - s2/2 + math.Sqrt(s2)*rng.NormFloat64())
	default:
		x = d.Mean
	}
	n := int(math.Round(x))
	if d.Max > 0 && n > d.Max {
		n = d.Max
	}
	return max(n, d.Min, 1)
}

// wordText returns n random words, each with a leading space.
func wordText(rng *rand.Rand, n int) string {
	var b strings.Builder
	b.Grow(4 * n)
	for range n {
		b.WriteByte(' ')
		b.WriteString(words[rng.IntN(len(words))])
	}
	return b.String()
}

// estimateTokens guesses a text's token count at four characters a token,
// a real tokenizer's rate on English; used only where no count is given
// (ShareGPT answers' lengths, which become max_tokens).
func estimateTokens(s string) int { return max(1, (len(s)+2)/4) }

// loadShareGPT reads a ShareGPT-format JSON file (an array of
// {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]})
// and keeps, as vllm bench serve does, the first turn and its answer of each
// conversation, skipping answers and prompts under 4 tokens and pairs over
// 1024 prompt or 2048 total tokens.
func loadShareGPT(path string) ([]item, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("bench: read sharegpt dataset: %w", err)
	}
	var convs []struct {
		Conversations []struct {
			From  string `json:"from"`
			Value string `json:"value"`
		} `json:"conversations"`
	}
	if err := json.Unmarshal(b, &convs); err != nil {
		return nil, fmt.Errorf("bench: parse sharegpt dataset %s: %w", path, err)
	}
	var items []item
	for _, c := range convs {
		if len(c.Conversations) < 2 {
			continue
		}
		in, out := estimateTokens(c.Conversations[0].Value), estimateTokens(c.Conversations[1].Value)
		if in < 4 || out < 4 || in > 1024 || in+out > 2048 {
			continue
		}
		items = append(items, item{prompt: c.Conversations[0].Value, inputLen: in, outputLen: out})
	}
	if len(items) == 0 {
		return nil, fmt.Errorf("bench: sharegpt dataset %s has no usable conversation", path)
	}
	return items, nil
}

// traceLine is one line of a JSONL trace, in Mooncake's format: timestamp
// in milliseconds from the trace's start, lengths in tokens, and hash ids
// of the prompt's 512-token blocks; prompt, when present, is sent as is.
type traceLine struct {
	Timestamp    float64  `json:"timestamp"`
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
	Prompt       string   `json:"prompt"`
}

// loadTrace reads a JSONL trace. Prompts are built from hash ids: each id
// always gives the same block of text, so requests that share a prefix in
// the trace share it on the server.
func loadTrace(path string, salt uint64) ([]item, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("bench: read trace: %w", err)
	}
	defer f.Close()
	var items []item
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var tl traceLine
		if err := json.Unmarshal([]byte(line), &tl); err != nil {
			return nil, fmt.Errorf("bench: trace %s line %d: %w", path, n, err)
		}
		if tl.OutputLength < 1 || (tl.InputLength < 1 && tl.Prompt == "") || tl.Timestamp < 0 {
			return nil, fmt.Errorf("bench: trace %s line %d: needs input_length, output_length >= 1 and timestamp >= 0", path, n)
		}
		it := item{prompt: tl.Prompt, inputLen: tl.InputLength, outputLen: tl.OutputLength,
			at: time.Duration(tl.Timestamp * float64(time.Millisecond))}
		if it.prompt == "" {
			var b strings.Builder
			left := tl.InputLength
			for _, h := range tl.HashIDs {
				if left <= 0 {
					break
				}
				k := min(left, TraceBlockTokens)
				b.WriteString(blockText(h, salt, k))
				left -= k
			}
			if left > 0 {
				b.WriteString(wordText(rand.New(rand.NewPCG(uint64(n), salt^0x9e3779b97f4a7c15)), left))
			}
			it.prompt = b.String()
		} else if it.inputLen == 0 {
			it.inputLen = estimateTokens(it.prompt)
		}
		items = append(items, it)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("bench: read trace %s: %w", path, err)
	}
	if len(items) == 0 {
		return nil, fmt.Errorf("bench: trace %s is empty", path)
	}
	for i := 1; i < len(items); i++ {
		if items[i].at < items[i-1].at {
			return nil, fmt.Errorf("bench: trace %s: timestamps go backwards at request %d", path, i+1)
		}
	}
	return items, nil
}

// blockText is the first k words of hash id h's block.
func blockText(h, salt uint64, k int) string {
	return wordText(rand.New(rand.NewPCG(h, salt)), k)
}
