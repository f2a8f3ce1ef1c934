package openai

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// Baton's JSON reads as written: "<", ">" and "&" are not escaped (json.Marshal would send
// "\u003ckey\u003e"), and the bytes are still JSON that decodes to the same values.
func TestMarshalJSONDoesNotEscapeHTML(t *testing.T) {
	rec := httptest.NewRecorder()
	WriteError(rec, &Error{Status: http.StatusUnauthorized, Code: CodeInvalidAPIKey, Message: "send 'Authorization: Bearer <key>' & retry"})
	body := rec.Body.String()
	if !strings.Contains(body, "Bearer <key>' & retry") || strings.Contains(body, `\u003c`) {
		t.Errorf("body %s", body)
	}
	var env struct{ Error struct{ Message string } }
	if err := json.Unmarshal(rec.Body.Bytes(), &env); err != nil || env.Error.Message != "send 'Authorization: Bearer <key>' & retry" {
		t.Errorf("decoded %+v, %v", env, err)
	}
	if got := string(MarshalJSON(map[string]int{"none-n>1": 2})); got != `{"none-n>1":2}` {
		t.Errorf("MarshalJSON: %s", got)
	}
}
