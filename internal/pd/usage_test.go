package pd

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// usageByJSON is readPrefillUsage as encoding/json reads it: the reference the scanner must
// agree with on what engines send.
func usageByJSON(body []byte) prefillUsage {
	var v struct {
		Usage *struct {
			PromptTokens  *int `json:"prompt_tokens"`
			InputTokens   *int `json:"input_tokens"`
			CacheRead     *int `json:"cache_read_input_tokens"`
			PromptDetails *struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
			InputDetails *struct {
				Cached int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(body, &v) != nil || v.Usage == nil {
		return prefillUsage{}
	}
	u := v.Usage
	cached := func(d *struct {
		Cached int `json:"cached_tokens"`
	}) int {
		if d == nil {
			return 0
		}
		return d.Cached
	}
	switch {
	case u.PromptTokens != nil:
		return prefillUsage{prompt: *u.PromptTokens, cached: cached(u.PromptDetails), ok: true}
	case u.InputTokens != nil && u.CacheRead != nil:
		return prefillUsage{prompt: *u.InputTokens, cached: *u.CacheRead, ok: true}
	case u.InputTokens != nil:
		return prefillUsage{prompt: *u.InputTokens, cached: cached(u.InputDetails), ok: true}
	}
	return prefillUsage{}
}

// usageBody builds a prefill answer whose usage has the members whose mask bit is set, each
// value written as given (so that non-integers can be tried too).
func usageBody(mask uint8, vals [5]string, extra string) []byte {
	keys := []string{"prompt_tokens", "input_tokens", "cache_read_input_tokens", "prompt_tokens_details", "input_tokens_details"}
	var members []string
	for i, k := range keys {
		if mask&(1<<i) == 0 {
			continue
		}
		v := vals[i]
		if i >= 3 && mask&(1<<(i+2)) != 0 { // details as an object around the value
			v = `{"cached_tokens":` + v + `,"x":[1,{"y":"}"}]}`
		}
		members = append(members, fmt.Sprintf("%q:%s", k, v))
	}
	return []byte(`{"id":"cmpl-1","choices":[{"text":"x"}],"usage":{` + strings.Join(members, ",") + `}` + extra + `}`)
}

// The scanner reads what encoding/json reads, on every combination of members engines send,
// with integers, nulls, and values that are not integers.
func FuzzReadPrefillUsage(f *testing.F) {
	f.Add(uint8(0b1001), "12", "0", "0", "3", "0", "")
	f.Add(uint8(0b0110), "0", "7", "2", "0", "0", `,"k":{"usage":1}`)
	f.Add(uint8(0b1_0010_010), "0", "9", "0", "0", "4", "")
	f.Add(uint8(0b1111_1111), "1.5", "-3", "null", `"4"`, "1e2", "")
	f.Fuzz(func(t *testing.T, mask uint8, a, b, c, d, e, extra string) {
		body := usageBody(mask, [5]string{a, b, c, d, e}, extra)
		if !json.Valid(body) {
			return // the answer is JSON: engines send nothing else
		}
		if got, want := readPrefillUsage(body), usageByJSON(body); got != want {
			t.Fatalf("%s: scanned %+v, encoding/json %+v", body, got, want)
		}
	})
}

func TestReadPrefillUsage(t *testing.T) {
	for _, tc := range []struct {
		body string
		want prefillUsage
	}{
		{`{"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}`, prefillUsage{12, 3, true}},
		{`{"usage":{"input_tokens":7,"cache_read_input_tokens":2}}`, prefillUsage{7, 2, true}},
		{`{"usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":4}}}`, prefillUsage{9, 4, true}},
		{`{"usage":{"prompt_tokens":null,"input_tokens":5}}`, prefillUsage{5, 0, true}},
		{`{"usage":{"prompt_tokens":1.5}}`, prefillUsage{}},
		{`{"usage":{"prompt_tokens":3,"prompt_tokens_details":"x"}}`, prefillUsage{}},
		{`{"usage":null}`, prefillUsage{}},
		{`{"choices":[]}`, prefillUsage{}},
	} {
		if got := readPrefillUsage([]byte(tc.body)); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.body, got, tc.want)
		}
		if got := usageByJSON([]byte(tc.body)); got != tc.want {
			t.Errorf("reference on %s: %+v, want %+v", tc.body, got, tc.want)
		}
	}
}
