package sim

import (
	"reflect"
	"testing"
)

var caseSensitiveSeeds = []string{
	`{"model":"m","prompt":"hello","max_tokens":16}`,
	` { "model" : "m" , "prompt" : [1,2,3] , "stream" : true } `,
	`{"model":"m","prompt":[1, 2, 3]}`,
	`{"model":"m","MAX_TOKENS":5,"max_tokens":3}`,
	`{"model":"m","max_tokens":5,"max_tokens":3}`,
	`{"stream_options":{"include_usage":true},"stream_options":{}}`,
	`{"stream_options":{"include_usage":true,"INCLUDE_USAGE":false},"stream":true}`,
	`{"stream_options":{"include_usage":true,"include_usage":false},"stream":true}`,
	`{"stream_options": { "include_usage" : true } ,"stream":true}`,
	`{"sampling_params":{"max_new_tokens":4,"Max_New_Tokens":9},"text":"x"}`,
	`{"sampling_params":{"max_new_tokens":4},"sampling_params":{"n":2},"text":"x"}`,
	`{"sampling_params":{"stop":[ "a" ]},"text":"x"}`,
	`{"sampling_params":null,"stream_options":"x"}`,
	`{"kv_transfer_params":{"do_remote_decode":true,"do_remote_decode":false}}`,
	`{"kv_transfer_params":{"do_remote_decode":true},"kv_transfer_params":{"remote_block_ids":[1]}}`,
	`{"tools":[{"type":"function", "function":{"name":"f"}}],"messages":[{"role":"user","content":"x"}]}`,
	`{"mod\u0065l":"m","model":"n"}`,
	`{"max_\u212aokens":7,"prompt":"p"}`,
	"{\"max_\xe2\x84\xaaokens\":7,\"prompt\":\"p\"}",
	"{\"prompt\":\"\xff\xfe\",\"max_tokens\":1}",
	"{\"prompt\":\"a\xe2\x80\xa8b\",\"max_tokens\":1}",
	`{"prompt":"a <b> & \u2028 \"q\" \\ ]}{[","max_tokens":2}`,
	`{"prompt":"a \"q\" \\ ]}{[","max_tokens":2}`,
	`{"bootstrap_host":"h<1>","bootstrap_room":12345678901234567890123}`,
	`{"messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"}"}]}]}`,
	`{"prompt":"a"} trailing`,
	`{"prompt":"a"}{"prompt":"b"}`,
	`{"prompt":"a",}`,
	`{"prompt":"a" "max_tokens":1}`,
	`{"max_tokens":"sixteen","n":"two","prompt":"p"}`,
	`{"n":"two","max_tokens":"sixteen","prompt":"p"}`,
	`{"max_tokens":1e400}`,
	`{"seed":12345678901234567890123}`,
	`{}`, `{ }`, `null`, `[]`, `"x"`, ``, `{`, `{"a":[}`, `{"a":tru}`, `{"a":"\`,
	`{"":1,"prompt":"p"}`,
}

// TestAPlainRequestIsDecodedAsItIs: a request with nothing to drop, nothing named twice and
// values as json.Marshal would write them is decoded without the rewrite; any other is not.
func TestAPlainRequestIsDecodedAsItIs(t *testing.T) {
	for body, plain := range map[string]bool{
		`{"model":"m","prompt":"hello","max_tokens":16}`:                      true,
		` { "model" : "m" , "max_tokens" : 16 } `:                             true,
		`{"model":"m","sampling_params":{ "max_new_tokens" : 4 },"text":"x"}`: true,
		`{"kv_transfer_params":{"a":1,"a":2},"prompt":"duplicates deeper"}`:   true,
		`{"model":"m","MAX_TOKENS":5,"max_tokens":3}`:                         false,
		`{"model":"m","max_tokens":5,"max_tokens":3}`:                         false,
		`{"sampling_params":{"max_new_tokens":4,"MAX_NEW_TOKENS":9}}`:         false,
		`{"stream_options":{"include_usage":true,"Include_Usage":false}}`:     false,
		`{"mod\u0065l":"m"}`:              false,
		`{"prompt":[1, 2]}`:               false,
		`{"prompt":"<b>"}`:                false,
		`{"kv_transfer_params":{ "a":1}}`: false,
		`{"prompt":"a"} trailing`:         false,
		`null`:                            false,
	} {
		if got := plainObject([]byte(body), requestFields(), nestedFields); got != plain {
			t.Errorf("plainObject(%s) = %v, want %v", body, got, plain)
		}
	}
}

// FuzzParseShortcut holds parse's shortcut to the rewrite it skips: whatever the body, the
// request decoded is the same, to the bytes of its raw members, and so is the error.
func FuzzParseShortcut(f *testing.F) {
	for _, s := range caseSensitiveSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got, gotErr := decodeCaseSensitive(body)
		want, wantErr := decodeRequest(caseSensitive(body))
		if (gotErr == nil) != (wantErr == nil) || gotErr != nil && gotErr.Error() != wantErr.Error() {
			t.Fatalf("body %q: error %v, the rewrite's %v", body, gotErr, wantErr)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("body %q: decoded %+v, the rewrite's %+v", body, got, want)
		}
	})
}
