package validate

import (
	"encoding/json"
	"errors"
	"strings"
)

// What a check reads from an OpenAI-format request and its answer.

// Answer returns the text a policy judges in a backend's answer to a chat
// completion (the first choice's message content) or a completion (the
// first choice's text).
func Answer(response []byte) (string, error) {
	var r struct {
		Choices []struct {
			Message *struct {
				Content *string `json:"content"`
			} `json:"message"`
			Text *string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(response, &r); err != nil {
		return "", err
	}
	if len(r.Choices) == 0 {
		return "", errors.New("the answer has no choices")
	}
	c := r.Choices[0]
	switch {
	case c.Message != nil && c.Message.Content != nil:
		return *c.Message.Content, nil
	case c.Text != nil:
		return *c.Text, nil
	}
	return "", errors.New("the answer's first choice has no content")
}

// Request is the part of an OpenAI-format request body a check reads.
type Request struct {
	ResponseFormat *struct {
		Type       string `json:"type"`
		JSONSchema *struct {
			Schema json.RawMessage `json:"schema"`
		} `json:"json_schema"`
	} `json:"response_format"`
	GuidedJSON json.RawMessage `json:"guided_json"`
	Messages   []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	} `json:"messages"`
	Prompt json.RawMessage `json:"prompt"`
}

// ParseRequest reads a request body.
func ParseRequest(body []byte) (Request, error) {
	var r Request
	err := json.Unmarshal(body, &r)
	return r, err
}

// Schema returns the request's own JSON Schema: response_format's
// json_schema.schema, or vLLM's guided_json; nil if it asked for none.
func (r Request) Schema() json.RawMessage {
	if f := r.ResponseFormat; f != nil && f.Type == "json_schema" && f.JSONSchema != nil && len(f.JSONSchema.Schema) > 0 {
		return f.JSONSchema.Schema
	}
	if len(r.GuidedJSON) > 0 && string(r.GuidedJSON) != "null" {
		if r.GuidedJSON[0] == '"' { // vLLM also takes the schema as a string
			var s string
			if json.Unmarshal(r.GuidedJSON, &s) == nil {
				return json.RawMessage(s)
			}
		}
		return r.GuidedJSON
	}
	return nil
}

// Source returns the request's user text: the user messages' content
// (text parts joined), or a completion's string prompt.
func (r Request) Source() string {
	var b strings.Builder
	for _, m := range r.Messages {
		if m.Role != "user" {
			continue
		}
		var s string
		if json.Unmarshal(m.Content, &s) == nil {
			b.WriteString(s)
			b.WriteByte('\n')
			continue
		}
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if json.Unmarshal(m.Content, &parts) == nil {
			for _, p := range parts {
				if p.Type == "text" {
					b.WriteString(p.Text)
					b.WriteByte('\n')
				}
			}
		}
	}
	var prompt string
	if json.Unmarshal(r.Prompt, &prompt) == nil {
		b.WriteString(prompt)
	}
	return b.String()
}

// ReplaceAnswer returns an OpenAI-format answer with its first choice's
// content (or text) replaced by answer, every other field as it was.
func ReplaceAnswer(response []byte, answer string) ([]byte, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(response, &top); err != nil {
		return nil, err
	}
	var choices []map[string]json.RawMessage
	if err := json.Unmarshal(top["choices"], &choices); err != nil || len(choices) == 0 {
		return nil, errors.New("the answer has no choices")
	}
	text, _ := json.Marshal(answer)
	switch {
	case choices[0]["message"] != nil:
		var msg map[string]json.RawMessage
		if err := json.Unmarshal(choices[0]["message"], &msg); err != nil {
			return nil, err
		}
		msg["content"] = text
		choices[0]["message"], _ = json.Marshal(msg)
	case choices[0]["text"] != nil:
		choices[0]["text"] = text
	default:
		return nil, errors.New("the answer's first choice has no content")
	}
	top["choices"], _ = json.Marshal(choices)
	return json.Marshal(top)
}
