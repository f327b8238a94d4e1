package gateway

import (
	"encoding/json"
	"strings"

	"github.com/kvgate/kvgate/scheduler"
)

// Llama-3 chat template markers: what vLLM renders a chat request into
// before it tokenizes it, and so what its prefix cache's block hashes
// cover. kvgate hashes the same text (scheduler.NewPrefix), so that two
// requests share chunks where vLLM will share blocks: the system prompt,
// the earlier turns of a conversation. Another model's template puts other
// markers between the messages; the prefix relation between requests, all
// that routing and the shared-block count need, is the same.
const (
	tmplBegin       = "<|begin_of_text|>"
	tmplStartHeader = "<|start_header_id|>"
	tmplEndHeader   = "<|end_header_id|>\n\n"
	tmplEOT         = "<|eot_id|>"
)

// promptPrefix returns the cacheable chunks of a call's prompt of
// promptTokens tokens, or nil when it has none kvgate can name: an
// embedding, several prompts, token ids, or a prompt under one chunk.
func promptPrefix(c *call, promptTokens int) *scheduler.Prefix {
	var text string
	switch c.ep {
	case epChat:
		t, ok := renderChat(c.f.Messages)
		if !ok {
			return nil
		}
		text = t
	case epCompletion:
		var p string
		if json.Unmarshal(c.f.Prompt, &p) != nil {
			return nil // token ids or a list of prompts
		}
		text = tmplBegin + p // the tokenizer adds the beginning of text
	default:
		return nil
	}
	return scheduler.NewPrefix(text, promptTokens)
}

// renderChat applies the Llama-3 template to a messages array, as vLLM's
// chat endpoint does, content parts joined by newlines; ok is false for
// messages that do not parse (the backend will refuse them).
func renderChat(raw json.RawMessage) (string, bool) {
	var msgs []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(raw, &msgs) != nil || len(msgs) == 0 {
		return "", false
	}
	var b strings.Builder
	b.WriteString(tmplBegin)
	for _, m := range msgs {
		b.WriteString(tmplStartHeader)
		b.WriteString(m.Role)
		b.WriteString(tmplEndHeader)
		var text string
		if len(m.Content) > 0 && json.Unmarshal(m.Content, &text) != nil {
			var parts []struct {
				Text string `json:"text"`
			}
			if json.Unmarshal(m.Content, &parts) != nil {
				return "", false
			}
			for i, p := range parts {
				if i > 0 {
					b.WriteByte('\n')
				}
				b.WriteString(p.Text)
			}
		}
		b.WriteString(text)
		b.WriteString(tmplEOT)
	}
	b.WriteString(tmplStartHeader + "assistant" + tmplEndHeader)
	return b.String(), true
}
