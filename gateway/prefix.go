package gateway

import (
	"encoding/json"
	"fmt"
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
// Their space is what vLLM's block hashes cover besides the text: the
// model (a LoRA adapter is a model of its own), the cache salt, and the
// tools (a template renders them into the prompt).
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
	space := c.model
	if len(c.f.CacheSalt) > 0 || toolBytes(c.f.Tools) > 0 {
		space += "\x00" + string(c.f.CacheSalt) + "\x00" + string(c.f.Tools)
	}
	return scheduler.NewPrefix(space, text, promptTokens)
}

// renderChat applies the Llama-3 template to a messages array, as vLLM's
// chat endpoint does, text parts joined by newlines; ok is false for
// messages that do not parse (the backend will refuse them). Another part
// (an image, audio) stands as a mark of its content's hash, as long as
// the estimate counts it, and an assistant's tool calls as themselves:
// vLLM's block hashes cover both,
// so two prompts that differ only there share no block from there on.
func renderChat(raw json.RawMessage) (string, bool) {
	var msgs []struct {
		Role      string          `json:"role"`
		Content   json.RawMessage `json:"content"`
		ToolCalls json.RawMessage `json:"tool_calls"`
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
			var parts []json.RawMessage
			if json.Unmarshal(m.Content, &parts) != nil {
				return "", false
			}
			for i, raw := range parts {
				var p struct {
					Type string  `json:"type"`
					Text *string `json:"text"`
				}
				if json.Unmarshal(raw, &p) != nil {
					return "", false
				}
				if i > 0 {
					b.WriteByte('\n')
				}
				if p.Type == "" || textParts[p.Type] { // as promptSize reads them
					if p.Text != nil {
						b.WriteString(*p.Text)
					}
					continue
				}
				// As long as the estimate counts the part (promptSize), so
				// that the chunks' tokens stay the text's.
				mark := fmt.Sprintf("<%s:%016x>", p.Type, scheduler.HashChunks(string(raw), len(raw))[0])
				b.WriteString(mark)
				b.WriteString(strings.Repeat(" ", max(0, mediaPartBytes-len(mark))))
			}
		}
		b.WriteString(text)
		if len(m.ToolCalls) > 0 && string(m.ToolCalls) != "null" {
			b.Write(m.ToolCalls)
		}
		b.WriteString(tmplEOT)
	}
	b.WriteString(tmplStartHeader + "assistant" + tmplEndHeader)
	return b.String(), true
}
