"use strict";

// The sign-in form (login.html) and the sign-out button (forbidden.html).
(() => {
  const MESSAGES = {
    invalid_credentials: "Wrong user name or password.",
    malformed_request: "Enter a user name and a password.",
  };

  async function signIn(event) {
    event.preventDefault();
    const error = document.getElementById("login-error");
    error.hidden = true;
    const credentials = {
      username: document.getElementById("username").value,
      password: document.getElementById("password").value,
    };
    let response;
    try {
      response = await fetch("/login", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(credentials),
        credentials: "same-origin",
      });
    } catch {
      error.textContent = "The broker cannot be reached.";
      error.hidden = false;
      return;
    }
    if (response.ok) {
      window.location.assign("/");
      return;
    }
    const body = await response.json().catch(() => ({}));
    if (body.reason === "rate_limit_exceeded") {
      const seconds = Math.ceil((body.retry_after_ms || 0) / 1000);
      error.textContent = `Too many attempts from this address: try again in ${seconds} s.`;
    } else {
      error.textContent = MESSAGES[body.reason] || `Sign-in failed (${response.status}).`;
    }
    error.hidden = false;
  }

  async function signOut() {
    await fetch("/logout", { credentials: "same-origin" }).catch(() => undefined);
    window.location.assign("/");
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("login-form")?.addEventListener("submit", signIn);
    document.getElementById("logout")?.addEventListener("click", signOut);
  });
})();
