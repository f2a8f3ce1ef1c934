package pd

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/record"
)

// FuzzFixUsage checks fixUsage, which finds the members it rewrites in one pass and replaces a
// lone usage in place, against fixUsageByGets, the same rules written with a Get per member and
// a Set: the same bytes out for any bytes in.
func FuzzFixUsage(f *testing.F) {
	for _, s := range []string{
		`{"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`,
		`{"usage":{"prompt_tokens":3,"completion_tokens":2},"usage":{"prompt_tokens":1}}`,
		`{"usage":{"input_tokens":3,"output_tokens":"2","input_tokens_details":{"cached_tokens":1}}}`,
		`{"type":"response.completed","response":{"usage":{"input_tokens":7,"output_tokens":1}}}`,
		`{"message":{"usage":{"input_tokens":7,"cache_read_input_tokens":0}},"response":5}`,
		`{"usage":{"prompt_tokens":3,"completion_tokens":1.5,"prompt_tokens_details":null}`,
		`{"usage":{"prompt_tokens":3,"completion_tokens":-0},"x":}`, `{"us\u0061ge":{"prompt_tokens":1}}`, `[]`, `{}`,
	} {
		f.Add([]byte(s), uint16(9), uint16(4))
	}
	f.Fuzz(func(t *testing.T, b []byte, prompt, cached uint16) {
		pu := prefillUsage{prompt: int(prompt), cached: int(cached), ok: true}
		if got, want := fixUsage(b, pu), fixUsageByGets(b, pu); !bytes.Equal(got, want) {
			t.Fatalf("fixUsage(%q) = %q; by Gets: %q", b, got, want)
		}
	})
}

// fixUsageByGets is fixUsage as written before it scanned the answer once, a Get for each member
// and a Set: the oracle of FuzzFixUsage.
func fixUsageByGets(obj []byte, pu prefillUsage) []byte {
	_, hasUsage := openai.GetLast(obj, "usage")
	for _, key := range []string{"response", "message"} {
		if inner, ok := openai.GetLast(obj, key); !hasUsage && ok && len(inner) > 0 && inner[0] == '{' {
			if fixed := fixUsageByGets(inner, pu); !bytes.Equal(fixed, inner) {
				if out, err := openai.Set(obj, key, fixed); err == nil {
					return out
				}
			}
			return obj
		}
	}
	u, ok := openai.GetLast(obj, "usage")
	if !ok || len(u) == 0 || u[0] != '{' {
		return obj
	}
	if _, ok := openai.GetLast(u, "cache_read_input_tokens"); ok {
		return fixAnthropicUsage(obj, u, pu)
	}
	u2, ok := fixedUsage(u, pu)
	if !ok {
		return obj
	}
	out, err := openai.Set(obj, "usage", u2)
	if err != nil {
		return obj
	}
	return out
}

// FuzzCompletionIsWhatUnmarshalReads: the completion count fixedUsage reads in place
// (intMember) is what encoding/json decodes into an int; where that fails, the whole number a
// float parser reads (1e2, 1.0: JavaScript's and Python's clients read those counts), within
// 2^53; else 0; for any value.
func FuzzCompletionIsWhatUnmarshalReads(f *testing.F) {
	for _, s := range []string{`5`, `-0`, `05`, `+5`, `1e2`, `1.0`, `"3"`, `null`, `99999999999999999999`, `-9223372036854775808`, `[1]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		obj := append(append([]byte(`{"completion_tokens":`), raw...), '}')
		if !json.Valid(obj) {
			return
		}
		var want int
		if json.Unmarshal(raw, &want) != nil {
			want = 0
			var f float64
			if json.Unmarshal(raw, &f) == nil && f == math.Trunc(f) && math.Abs(f) <= 1<<53 {
				want = int(f)
			}
		}
		if got, _, _ := intMember(obj, "completion_tokens"); got != want {
			t.Fatalf("intMember of %q = %d; encoding/json: %d", raw, got, want)
		}
	})
}

// FuzzDecodeUsage checks decodeUsage, which reads the answer's top level from the one scan the
// rewrite shares (scanTop), against decodeUsageByGets, the same rules written with a Get per
// member: the same prompt, cached and verdict for any bytes in.
func FuzzDecodeUsage(f *testing.F) {
	for _, s := range []string{
		`{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":2}}}`,
		`{"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":1}},"usage":{"prompt_tokens":9}}`,
		`{"type":"response.completed","response":{"usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":6}}}}`,
		`{"response":"text","usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":0}}}`,
		`{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}`, `{"response":{"usage":{}},"x":}`,
		`{"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":1}},"x":}`, `[]`, `{}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		p, c, ok := decodeUsage(b)
		wp, wc, wok := decodeUsageByGets(b)
		if p != wp || c != wc || ok != wok {
			t.Fatalf("decodeUsage(%q) = %d, %d, %v; by Gets: %d, %d, %v", b, p, c, ok, wp, wc, wok)
		}
	})
}

// decodeUsageByGets is decodeUsage as written before it shared the rewrite's scan, a Get for
// each member: the oracle of FuzzDecodeUsage.
func decodeUsageByGets(obj []byte) (prompt, cached int, ok bool) {
	if _, hasUsage := openai.GetLast(obj, "usage"); !hasUsage {
		if inner, found := openai.GetLast(obj, "response"); found && len(inner) > 0 && inner[0] == '{' {
			obj = inner
		}
	}
	u, found := openai.GetLast(obj, "usage")
	if !found || len(u) == 0 || u[0] != '{' {
		return 0, 0, false
	}
	for _, k := range [...][2]string{{"prompt_tokens", "prompt_tokens_details"}, {"input_tokens", "input_tokens_details"}} {
		p, present, okP := intMember(u, k[0])
		if !present || !okP {
			continue
		}
		raw, found := openai.GetLast(u, k[1])
		if !found || len(raw) == 0 || raw[0] != '{' {
			return 0, 0, false
		}
		c, present, okC := intMember(raw, "cached_tokens")
		return p, c, present && okC
	}
	return 0, 0, false
}

// cachedOf reads the cached tokens of an answer's usage as a client does (encoding/json: the
// last of a repeated key).
func cachedOf(t *testing.T, obj []byte) int {
	t.Helper()
	var got struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(obj, &got); err != nil {
		t.Fatalf("%v: %s", err, obj)
	}
	return got.Usage.Details.Cached
}

// A decode that hides its recompute from the check in how it writes a streamed event — a key
// spelled with escapes, the JSON split over two data lines, a repeated usage whose last one
// is what clients read — is seen all the same, and its usage rewritten as a client reads it.
func TestAStreamedRecomputeCannotHideInTheEventsSpelling(t *testing.T) {
	const usage0 = `{"prompt_tokens":100,"completion_tokens":5,"total_tokens":105,"prompt_tokens_details":{"cached_tokens":0}}`
	pu := prefillUsage{prompt: 100, cached: 40, ok: true}
	for name, ev := range map[string]string{
		"an escaped key": "data: {\"id\":\"chatcmpl-r1\",\"choices\":[],\"us\\u0061ge\":" + usage0 + "}\n\n",
		"two data lines": "data: {\"id\":\"chatcmpl-r1\",\"choices\":[],\ndata: \"usage\":" + usage0 + "}\n\n",
		"a repeated usage": "data: {\"id\":\"chatcmpl-r1\",\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":99}}," +
			"\"usage\":" + usage0 + "}\n\n",
	} {
		var c kvCheck
		out := checkedEvent(&c, pu)([]byte(ev))
		if !c.recomputed() {
			t.Errorf("%s: the decode's recompute went unseen (verdict %q)", name, c.verdict())
		}
		data, ok := openai.EventData(out)
		if !ok || bytes.Count(out, []byte("data:")) != 1 {
			t.Fatalf("%s: the rewritten event is not one data line: %q", name, out)
		}
		if got := cachedOf(t, data); got != pu.cached {
			t.Errorf("%s: the client reads cached_tokens %d, want the prefill's %d: %s", name, got, pu.cached, out)
		}
	}
}

// In a whole answer with a repeated usage, the check reads the usage the client will read (the
// last), whether or not the prefill's usage is known for a rewrite.
func TestAWholeAnswersRepeatedUsageIsCheckedAsTheClientReadsIt(t *testing.T) {
	const answer = `{"id":"chatcmpl-r1","choices":[],"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":99}},` +
		`"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":0}}}`
	for _, pu := range []prefillUsage{{}, {prompt: 100, cached: 40, ok: true}} {
		var c kvCheck
		rec := &record.Record{}
		out := checkedBody(rec, &c, pu)([]byte(answer))
		if rec.Handoff != HandoffRecomputed {
			t.Errorf("prefill usage known %v: the record's handoff is %q, want %q", pu.ok, rec.Handoff, HandoffRecomputed)
		}
		if !c.recomputed() {
			t.Errorf("prefill usage known %v: the client reads cached_tokens %d of the answer, Baton's verdict %q", pu.ok, cachedOf(t, []byte(answer)), c.verdict())
		}
		if got := cachedOf(t, out); pu.ok && got != pu.cached {
			t.Errorf("the rewritten answer says cached_tokens %d, want %d: %s", got, pu.cached, out)
		}
	}
}

// Counts at the integers' ends are compared without wrapping: cached equal to prompt at the
// largest integer is a received handoff, not a recompute.
func TestTheRecomputeCheckDoesNotWrap(t *testing.T) {
	for _, c := range []struct {
		prompt, cached string
		want           string
	}{
		{"9223372036854775807", "9223372036854775807", VerdictReceived},
		{"9223372036854775807", "9223372036854775806", VerdictReceived},
		{"9223372036854775807", "0", VerdictRecomputed},
		{"9223372036854775807", "-9223372036854775808", VerdictRecomputed},
		{"100", "99", VerdictReceived},
		{"100", "98", VerdictRecomputed},
	} {
		var check kvCheck
		check.observeTop(scanTop([]byte(`{"usage":{"prompt_tokens":` + c.prompt + `,"prompt_tokens_details":{"cached_tokens":` + c.cached + `}}}`)))
		if got := check.verdict(); got != c.want {
			t.Errorf("prompt %s, cached %s: %q, want %q", c.prompt, c.cached, got, c.want)
		}
	}
}

// An answer's own top-level usage is the one checked and rewritten, whatever object beside it is
// named response or message: a client reads that usage.
func TestAnAnswersOwnUsageIsReadBesideAResponseMember(t *testing.T) {
	body := []byte(`{"id":"x","response":{},"message":{"usage":{"input_tokens":1}},"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":0}}}`)
	var check kvCheck
	check.observeTop(scanTop(body))
	if check.verdict() != VerdictRecomputed {
		t.Errorf("verdict %q; the answer's usage says recomputed", check.verdict())
	}
	if got := cachedOf(t, fixUsage(body, prefillUsage{prompt: 100, cached: 10, ok: true})); got != 10 {
		t.Errorf("the client reads cached_tokens %d, want the prefill's 10", got)
	}
}

// sseData is an event's data as an SSE client reads it: CR, LF and CRLF each end a line, and the
// "data:" lines' payloads are joined by newlines.
func sseData(ev string) string {
	ev = strings.ReplaceAll(strings.ReplaceAll(ev, "\r\n", "\n"), "\r", "\n")
	var parts []string
	for _, l := range strings.Split(ev, "\n") {
		if d, ok := strings.CutPrefix(l, "data:"); ok {
			parts = append(parts, strings.TrimPrefix(d, " "))
		}
	}
	return strings.Join(parts, "\n")
}

// A line that a lone CR ends (here a comment's, with a data line behind it that a client reads)
// cannot hide the decode's recompute, and the rewritten event is one a client reads as JSON with
// the prefill's usage.
func TestALoneCRCannotHideAStreamedRecompute(t *testing.T) {
	ev := "data: {\"usage\":{\"prompt_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":99}}\n" +
		": c\rdata: ,\"usage\":{\"prompt_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":0}}\n" +
		"data: }\n\n"
	if got := cachedOf(t, []byte(sseData(ev))); got != 0 {
		t.Fatalf("the client reads cached_tokens %d of the decode's event, want 0", got)
	}
	var check kvCheck
	out := checkEvent([]byte(ev), &check, prefillUsage{prompt: 100, cached: 10, ok: true})
	if check.verdict() != VerdictRecomputed {
		t.Errorf("verdict %q; the client reads a recompute", check.verdict())
	}
	if got := cachedOf(t, []byte(sseData(string(out)))); got != 10 {
		t.Errorf("the client reads cached_tokens %d of the rewritten event %q, want the prefill's 10", got, out)
	}
}
