package proxy

import (
	"bytes"
	"sync"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/record"
)

// usageTailLen is how much of an answer's end the relay keeps: OpenAI-style answers put their
// usage last, in their last event or at the end of their object.
const usageTailLen = 1 << 10

var tailPool = sync.Pool{New: func() any { return new([usageTailLen]byte) }}

// usageTail keeps the last bytes an answer carried to the client, for its usage once it ended.
// The buffer is taken from a pool at the first byte and given back by done.
type usageTail struct {
	b *[usageTailLen]byte
	n int
	// A stream takes its buffer only from the chunk where "usage" first appears (its last
	// event, or every event when the engine reports usage continuously): carry holds the end
	// of the chunks before it, so that a key split between two reads is found.
	carry [len(usageKey) - 1]byte
	nc    int
}

const usageKey = `"usage"`

// keep adds chunk to the tail.
func (t *usageTail) keep(chunk []byte) {
	if len(chunk) == 0 {
		return
	}
	if t.b == nil {
		t.b = tailPool.Get().(*[usageTailLen]byte)
	}
	if len(chunk) >= usageTailLen {
		t.n = copy(t.b[:], chunk[len(chunk)-usageTailLen:])
		return
	}
	keep := min(t.n, usageTailLen-len(chunk))
	copy(t.b[:keep], t.b[t.n-keep:t.n])
	t.n = keep + copy(t.b[keep:], chunk)
}

// keepStream adds a stream's chunk to the tail once the stream mentioned its usage; until then
// it holds no buffer, only the last bytes of what it saw.
func (t *usageTail) keepStream(chunk []byte) {
	if t.b == nil {
		var joint [2 * (len(usageKey) - 1)]byte
		n := copy(joint[:], t.carry[:t.nc])
		n += copy(joint[n:], chunk)
		if !bytes.Contains(joint[:n], []byte(usageKey)) && !bytes.Contains(chunk, []byte(usageKey)) {
			if len(chunk) >= len(t.carry) {
				t.nc = copy(t.carry[:], chunk[len(chunk)-len(t.carry):])
			} else {
				keep := min(t.nc, len(t.carry)-len(chunk))
				copy(t.carry[:keep], t.carry[t.nc-keep:t.nc])
				t.nc = keep + copy(t.carry[keep:], chunk)
			}
			return
		}
		t.keep(t.carry[:t.nc])
	}
	t.keep(chunk)
}

// done writes the answer's usage on rec when it ended with one, and gives the buffer back.
func (t *usageTail) done(rec *record.Record, ended bool) {
	if t.b == nil {
		return
	}
	if ended {
		rec.Usage, rec.UsageKnown = openai.LastUsage(t.b[:t.n])
	}
	tailPool.Put(t.b)
	t.b, t.n = nil, 0
}

// NoteUsage writes the usage of a whole answer on rec (the PD path relays non-streamed answers
// itself, after its usage rewrite).
func NoteUsage(rec *record.Record, body []byte) {
	if b := bytes.TrimLeft(body, " \t\r\n"); len(b) > 0 && b[0] == '[' {
		var s openai.SampleSum // a /generate batch: every sample's
		s.Feed(body)
		rec.Usage, rec.UsageKnown = s.Usage(rec.Samples)
		return
	}
	rec.Usage, rec.UsageKnown = openai.LastUsage(body)
}

// accounting wraps a stream's event transform for a tenant's accounting: it reads the usage
// the events carry (whole, or a part per event as Anthropic's stream gives it; with
// continuous_usage_stats, each choice's completion so far on every event), and, when Baton asked
// the engine for usage the client did not, takes it out of the stream: the usage-only event
// (o.StripUsage), and every other event's usage (o.On's stripEach). The usage seen is returned
// through the pointer, complete when both counts were seen.
func accounting(rec *record.Record, o Orders, inner func([]byte) []byte) (func([]byte) []byte, *streamUsage) {
	seen := &streamUsage{}
	return func(ev []byte) []byte {
		if inner != nil {
			ev = inner(ev)
		}
		u, okP, okC := openai.EventUsage(ev)
		if okP {
			seen.u.Prompt, seen.u.Cached, seen.p = u.Prompt, u.Cached, true
			rec.EnginePrompt = u.Prompt // the engine's count, should the stream not end
		}
		if okC {
			seen.u.Completion, seen.c = u.Completion, true
			seen.note(ev, u)
		}
		if (o.StripUsage || o.stripEach) && openai.IsUsageOnlyEvent(ev) {
			if o.StripUsage {
				return nil
			}
			return ev
		}
		if o.stripEach && (okP || okC) {
			return openai.WithoutEventUsage(ev, o.nullEach)
		}
		return ev
	}, seen
}

// maxChoices bounds the choices whose completion a stream's accounting follows (a request's
// samples are bounded far below it, --max-batch-size).
const maxChoices = 256

// streamUsage is the usage a stream's events carried.
type streamUsage struct {
	u    openai.Usage
	p, c bool
	// byChoice is the usage each choice's (or /generate sample's) events last reported
	// (continuous_usage_stats reports a choice's own count on its events; a /generate batch
	// streams each sample's with its index); total, when hasTotal, is the completion of an event
	// for the whole answer (the usage-only event, or an answer of one sample).
	byChoice []openai.Usage
	total    int
	hasTotal bool
}

// note records the usage an event reported: its choice's, or the whole answer's.
func (s *streamUsage) note(ev []byte, u openai.Usage) {
	i, ok := openai.ChoiceIndex(ev)
	switch {
	case !ok:
		s.total, s.hasTotal = u.Completion, true
	case i < maxChoices:
		if i >= len(s.byChoice) {
			s.byChoice = append(s.byChoice, make([]openai.Usage, i+1-len(s.byChoice))...)
		}
		s.byChoice[i] = u
	}
}

// completion is the completion tokens the stream's events reported last, and whether any did:
// the whole answer's count when an event gave it, else the sum of its choices'.
func (s *streamUsage) completion() (int, bool) {
	if s.hasTotal {
		return s.total, true
	}
	n := 0
	for _, c := range s.byChoice {
		n += c.Completion
	}
	return n, len(s.byChoice) > 0
}

// prompts is how many of a request's prompts (of samples samples each) the stream's events
// reported the usage of: all of them when an event gave the whole answer's, else those of the
// choices seen (choice i is prompt i/samples's, as vLLM and SGLang number a batch's samples).
func (s *streamUsage) prompts(samples, prompts int) int {
	if s.hasTotal {
		return prompts
	}
	samples = max(samples, 1)
	seen := 0
	for i := 0; i < len(s.byChoice); i += samples {
		for j := i; j < min(i+samples, len(s.byChoice)); j++ {
			if s.byChoice[j] != (openai.Usage{}) {
				seen++
				break
			}
		}
	}
	return seen
}

// whole is the usage of a stream that ended: its last whole usage (the usage-only event, an
// answer of one sample), or the sum of its choices' — their prompt once per prompt, given
// samples per prompt — where no event gave the whole (a /generate batch).
func (s *streamUsage) whole(samples int) (openai.Usage, bool) {
	if s.hasTotal || len(s.byChoice) == 0 {
		return s.u, s.p && s.c
	}
	var u openai.Usage
	for _, c := range s.byChoice {
		u.Prompt, u.Completion, u.Cached = u.Prompt+c.Prompt, u.Completion+c.Completion, u.Cached+c.Cached
	}
	if samples > 1 {
		u.Prompt, u.Cached = u.Prompt/samples, u.Cached/samples
	}
	return u, s.p && s.c
}
