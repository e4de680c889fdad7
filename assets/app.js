// TriForce Studio: a click on a token of an answer opens it in the inspector. Each token carries
// data-tf="turn:segment"; the key goes to the hidden #tf-pick box, whose change event runs the
// inspector's handler (with a nonce, so a second click on the same token fires again).
document.addEventListener("click", (event) => {
  const token = event.target.closest("#tf-chat [data-tf]");
  if (!token) return;
  const box = document.querySelector("#tf-pick textarea, #tf-pick input");
  if (!box) return;
  box.value = `${token.dataset.tf}@${Date.now()}`;
  box.dispatchEvent(new Event("input", { bubbles: true }));
  document.querySelectorAll("#tf-chat .tf-picked").forEach((el) => el.classList.remove("tf-picked"));
  token.classList.add("tf-picked");
});
