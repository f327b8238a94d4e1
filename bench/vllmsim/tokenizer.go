package vllmsim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// The stand-in tokenizer. It is deterministic, reversible and needs no
// vocabulary file: a token is either a special token (Llama-3 ids), a piece
// of one to three lowercase ASCII letters with an optional leading space, or
// a single byte (byte fallback, as real BPE vocabularies have). English text
// comes out at roughly three characters a token, near a real tokenizer's
// four, which is what capacity planning needs; the ids match no real model.
//
// Token id layout:
//
//	0..255               raw bytes
//	256..36811           pieces: space flag × length 1..3 × letters
//	128000..             special tokens
const (
	byteTokens  = 256
	pieceBase   = byteTokens
	pieces1     = 26
	pieces2     = 26 * 26
	pieces3     = 26 * 26 * 26
	piecesNoSp  = pieces1 + pieces2 + pieces3
	pieceEnd    = pieceBase + 2*piecesNoSp
	specialBase = 128000
	vocabSize   = 128256 // as Llama-3's, so ids look plausible to clients
)

// Llama-3 special tokens, used by the chat template.
const (
	tokBeginOfText = 128000
	tokEndOfText   = 128001
	tokStartHeader = 128006
	tokEndHeader   = 128007
	tokEOT         = 128009
)

var specialTokens = map[int]string{
	tokBeginOfText: "<|begin_of_text|>",
	tokEndOfText:   "<|end_of_text|>",
	tokStartHeader: "<|start_header_id|>",
	tokEndHeader:   "<|end_header_id|>",
	tokEOT:         "<|eot_id|>",
}

func isLower(c byte) bool { return c >= 'a' && c <= 'z' }

// Tokenize turns text into token ids, prefixed with the beginning-of-text
// token when addSpecial is set. Special-token strings in the text become
// their ids, as vLLM's tokenizers do for chat templates.
func Tokenize(text string, addSpecial bool) []int {
	toks := make([]int, 0, len(text)/3+2)
	if addSpecial {
		toks = append(toks, tokBeginOfText)
	}
	for i := 0; i < len(text); {
		if text[i] == '<' && i+1 < len(text) && text[i+1] == '|' {
			if id, n := matchSpecial(text[i:]); n > 0 {
				toks = append(toks, id)
				i += n
				continue
			}
		}
		space := 0
		j := i
		if text[j] == ' ' && j+1 < len(text) && isLower(text[j+1]) {
			space = 1
			j++
		}
		if !isLower(text[j]) {
			toks = append(toks, int(text[i]))
			i++
			continue
		}
		n := 0
		v := 0
		for n < 3 && j+n < len(text) && isLower(text[j+n]) {
			v = v*26 + int(text[j+n]-'a')
			n++
		}
		toks = append(toks, pieceID(space == 1, n, v))
		i = j + n
	}
	return toks
}

func matchSpecial(s string) (id, n int) {
	for id, str := range specialTokens {
		if strings.HasPrefix(s, str) {
			return id, len(str)
		}
	}
	return 0, 0
}

func pieceID(space bool, n, v int) int {
	off := v
	switch n {
	case 2:
		off += pieces1
	case 3:
		off += pieces1 + pieces2
	}
	if space {
		off += piecesNoSp
	}
	return pieceBase + off
}

// TokenString returns the text of one token id; ids outside the stand-in
// vocabulary yield the empty string and false.
func TokenString(id int) (string, bool) {
	switch {
	case id >= 0 && id < byteTokens:
		return string([]byte{byte(id)}), true
	case id >= pieceBase && id < pieceEnd:
		off := id - pieceBase
		var b []byte
		if off >= piecesNoSp {
			b = append(b, ' ')
			off -= piecesNoSp
		}
		n := 1
		switch {
		case off >= pieces1+pieces2:
			n, off = 3, off-pieces1-pieces2
		case off >= pieces1:
			n, off = 2, off-pieces1
		}
		letters := make([]byte, n)
		for k := n - 1; k >= 0; k-- {
			letters[k] = 'a' + byte(off%26)
			off /= 26
		}
		return string(append(b, letters...)), true
	}
	s, ok := specialTokens[id]
	return s, ok
}

// Detokenize turns token ids back into text. Special tokens are kept when
// skipSpecial is false. An id outside the vocabulary is an error, as it is
// for vLLM.
func Detokenize(ids []int, skipSpecial bool) (string, error) {
	var sb strings.Builder
	for _, id := range ids {
		s, ok := TokenString(id)
		if !ok {
			if id >= 0 && id < vocabSize {
				continue // reserved id: decodes to nothing
			}
			return "", fmt.Errorf("token id %d is out of vocabulary", id)
		}
		if skipSpecial && id >= specialBase {
			continue
		}
		sb.WriteString(s)
	}
	return sb.String(), nil
}

// ChatMessage is one message of a chat request, after its content parts are
// joined into text.
type ChatMessage struct {
	Role    string
	Content string
}

// RenderChat applies a Llama-3 style chat template. With generationPrompt the
// text ends with the assistant header, ready for the model to continue.
func RenderChat(msgs []ChatMessage, generationPrompt bool) string {
	var sb strings.Builder
	sb.WriteString(specialTokens[tokBeginOfText])
	for _, m := range msgs {
		sb.WriteString(specialTokens[tokStartHeader])
		sb.WriteString(m.Role)
		sb.WriteString(specialTokens[tokEndHeader])
		sb.WriteString("\n\n")
		sb.WriteString(m.Content)
		sb.WriteString(specialTokens[tokEOT])
	}
	if generationPrompt {
		sb.WriteString(specialTokens[tokStartHeader])
		sb.WriteString("assistant")
		sb.WriteString(specialTokens[tokEndHeader])
		sb.WriteString("\n\n")
	}
	return sb.String()
}

// RenderChatTools is RenderChat with a request's tools, as a chat
// template renders them: their JSON in a system turn ahead of the
// messages, so that a request's tool schemas count in its prompt tokens.
func RenderChatTools(msgs []ChatMessage, tools json.RawMessage, generationPrompt bool) string {
	var b bytes.Buffer
	if t := bytes.TrimSpace(tools); len(t) > 0 && string(t) != "null" && string(t) != "[]" && json.Compact(&b, t) == nil {
		msgs = append([]ChatMessage{{Role: "system", Content: "Environment: tools\n" + b.String()}}, msgs...)
	}
	return RenderChat(msgs, generationPrompt)
}

// outputWords are the pieces the simulated model "generates": short English
// words, each one token, so that streamed text reads as words.
var outputWords = func() []int {
	words := strings.Fields("the of and to in is it for on that was he with as his they at be this from " +
		"have or by one had not but what all were we when your can said there use an each which she do " +
		"how their if will up other about out many then them these so some her would make like him into " +
		"time has two more go see way could no my than first been call who its now find long down day did " +
		"get come made may part kv gpu gate token cache batch queue job run fast")
	ids := make([]int, 0, len(words))
	for _, w := range words {
		if len(w) > 3 {
			continue
		}
		t := Tokenize(" "+w, false)
		if len(t) == 1 {
			ids = append(ids, t[0])
		}
	}
	return ids
}()
